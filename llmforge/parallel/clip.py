"""Gradient norm and clipping over every parallel dimension, with no host synchronisation.

Each rank holds shards (tensor parallel, FSDP) and copies (data parallel
replicas, tensor-parallel replicated parameters) of the gradients of its
pipeline stage. A local shard's sum of squares is divided by the number of ranks
holding that same shard, so summing over all ranks counts every element once.

The norm stays on the device: one ``torch._foreach_norm`` per kind of shard, one
sum in float64, one all-reduce over all ranks (none in one process), and the
clip is one ``torch._foreach_mul_`` by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does. Nothing is read back to the host: the
caller decides when (and whether) to look at the norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from llmforge.parallel.dtensor import local


@dataclass
class GlobalClip:
    """``clip(max_norm)`` returns the global gradient L2 norm (a float64 device
    tensor) and clips to it when ``max_norm > 0``.

    ``ranks_per_stage`` is world size / pp: the ranks among which a stage's
    parameters are sharded or replicated (1 in one process). ``skip`` holds
    parameters that are copies of another one (a tied weight held by two
    stages): counted once. ``distributed``: sum over all ranks of the default group."""

    params: list[nn.Parameter]
    ranks_per_stage: int = 1
    skip: set[int] = field(default_factory=set)
    distributed: bool = False
    #: Where the norm is returned: the compute device (offloaded gradients' norm is summed on the host).
    device: torch.device | None = None
    #: The group summing the norm (None: the default one); offloaded on GPUs: a gloo group, for host tensors.
    group: dist.ProcessGroup | None = None
    _copies_of: dict[int, int] = field(default_factory=dict, repr=False)

    def __call__(self, max_norm: float, *, flags: torch.Tensor | None = None) -> torch.Tensor:
        """``flags``: a 1-D float tensor on the gradients' device, summed in place over
        every rank by the norm's own all-reduce (no collective of its own): how the ranks
        agree on what one of them saw (a NaN in a slot on any rank is a NaN on all)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = self.norm(grads, flags=flags)
        if max_norm > 0 and grads:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for dtype, tensors in _by_dtype([local(g) for g in grads]).items():
                torch._foreach_mul_(tensors, coef.to(dtype))
        return norm if self.device is None or norm.device == self.device else norm.to(self.device)

    def norm(self, grads: list[torch.Tensor], *, flags: torch.Tensor | None = None) -> torch.Tensor:
        """The global L2 norm of the gradients (float64, on their device); ``flags`` as in ``__call__``."""
        buckets: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is None or id(p) in self.skip:
                continue
            grad = local(p.grad)
            buckets.setdefault((self._copies(p), grad.dtype), []).append(grad)
        held = grads or self.params  # a rank may hold no gradient; its zero still joins the all-reduce
        device = local(held[0]).device if held else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
        for (copies, _), tensors in buckets.items():
            squares = torch.stack(torch._foreach_norm(tensors)).double().square().sum()
            total = total + (squares / copies if copies > 1 else squares)
        if flags is not None and self.distributed:
            # Offloaded gradients are summed on the host while the flags stay on the device.
            both = torch.cat([total.reshape(1), flags.to(total.device)])
            dist.all_reduce(both, group=self.group)
            flags.copy_(both[1:])
            return both[0].sqrt()
        if self.distributed:
            dist.all_reduce(total, group=self.group)
        return total.sqrt()

    def _copies(self, p: nn.Parameter) -> int:
        """Ranks (of this stage) that hold the same elements as this rank's gradient of ``p``."""
        key = id(p)
        if key not in self._copies_of:
            shards = 1
            grad = p.grad
            if isinstance(grad, DTensor):
                for dim, placement in enumerate(grad.placements):
                    if placement.is_shard() or isinstance(placement, _StridedShard):
                        shards *= grad.device_mesh.size(dim)
            self._copies_of[key] = self.ranks_per_stage // shards
        return self._copies_of[key]


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out
