"""Data parallelism and the ZeRO stages, and what each really shards.

- ZeRO 0: every rank holds the whole (tensor/pipeline-local) model, gradients and
  optimizer states; after the step's last backward the gradients are all-reduced
  over the data-parallel group in ``precision.reduce_dtype`` (one flat buffer per dtype).
- ZeRO 1, 2, 3 use FSDP2 ``fully_shard`` per transformer block and on the root,
  which always shards parameters and optimizer states between steps:
  - 3: parameters are re-sharded after forward and gathered again for backward;
  - 2: parameters stay gathered from forward to backward (no second all-gather);
    gradients are reduce-scattered after every microbatch, so only a gradient shard
    is kept;
  - 1: as 2, but gradients of all microbatches are accumulated unsharded and
    reduce-scattered once at the end of the step (optimizer states sharded,
    gradients whole while accumulating).
  Under pipeline parallelism the pipeline schedule decides when to reduce
  (once, after a stage's last microbatch), so stages 1 and 2 behave alike there.
Expert weights (``parallel.ep`` > 1) are already split over the ep ranks, so they
are reduced, and ZeRO-sharded, over ``dp_rest`` only: the data-parallel ranks
that hold replicas of the same experts. Their gradient is the sum over those
ranks divided by the whole data-parallel size (each rank's loss is its own mean),
so ZeRO 0 divides by dp after the replica all-reduce, and ZeRO 1-3 put each
MoE layer's experts in their own FSDP2 unit on the ``dp_rest`` mesh with a
gradient divide factor of dp.
Gradient reduction runs in ``precision.reduce_dtype`` (FSDP2 MixedPrecisionPolicy);
compute precision comes from autocast, so the master weights stay fp32 everywhere.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from llmforge.train.precision import DTYPES


def apply_fsdp(model: nn.Module, *, dp_mesh: DeviceMesh, zero: int, reduce_dtype: str, expert_mesh: Optional[DeviceMesh] = None) -> None:
    """Shard ``model`` over ``dp_mesh`` with FSDP2 for ZeRO stage 1, 2 or 3.

    ``expert_mesh`` (the ``dp_rest`` mesh, set when experts are split over ep
    ranks) shards each MoE layer's expert weights over the replicas of the same
    experts, with gradients divided by the whole data-parallel size."""
    mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=DTYPES[reduce_dtype])
    reshard = zero == 3
    for block in model.layers.values():
        if expert_mesh is not None:
            _shard_experts(block, mesh=expert_mesh, dp_size=dp_mesh.size(), reshard=reshard, mp=mp)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def _shard_experts(block: nn.Module, *, mesh: DeviceMesh, dp_size: int, reshard: bool, mp: MixedPrecisionPolicy) -> None:
    from llmforge.parallel.expert import ExpertParallelExperts

    for module in list(block.modules()):
        if isinstance(module, ExpertParallelExperts):
            unit = fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
            unit.set_gradient_divide_factor(float(dp_size))
            if mesh.device_type == "cpu" and mesh.size() > 1:
                # gloo has no PREMUL_SUM. (On one rank FSDP2 divides without a
                # collective, and forcing sums there would divide twice.)
                unit.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def fsdp_sync(model: nn.Module, *, sync: bool) -> Iterator[None]:
    """Suspend FSDP's gradient reduce-scatter inside the block unless ``sync``."""
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass
class GradAllReduce:
    """ZeRO 0: sum gradients over ``group`` and divide by ``size``, in ``dtype``
    (the data-parallel group and size; for expert weights the ``dp_rest`` group
    and the data-parallel size)."""

    params: List[nn.Parameter]
    group: dist.ProcessGroup
    size: int
    dtype: torch.dtype

    def __call__(self) -> None:
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        for kind in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == kind]
            flat = torch.cat([g.reshape(-1) for g in same]).to(self.dtype)
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.size)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
