"""Gradient norm and clipping over every parallel dimension.

Each rank holds shards (tensor parallel, FSDP) and copies (data parallel
replicas, tensor-parallel replicated parameters) of the gradients of its
pipeline stage. A local shard's sum of squares is divided by the number of ranks
holding that same shard, so summing over all ranks counts every element once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


@dataclass
class GlobalClip:
    """``clip(max_norm)`` returns the global gradient L2 norm and clips to it.

    ``ranks_per_stage`` is world size / pp: the ranks among which a stage's
    parameters are sharded or replicated. ``skip`` holds parameters that are
    copies of another one (a tied weight held by two stages): counted once."""

    params: List[nn.Parameter]
    ranks_per_stage: int
    skip: Set[int] = field(default_factory=set)

    def __call__(self, max_norm: float) -> float:
        total = torch.zeros((), dtype=torch.float64)
        grads = [p.grad for p in self.params if p.grad is not None]
        for p in self.params:
            if p.grad is None or id(p) in self.skip:
                continue
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            total += local.double().pow(2).sum().cpu() / self._copies(p.grad)
        device = (grads or self.params)[0].device if grads or self.params else torch.device("cpu")
        total = total.to(device)
        dist.all_reduce(total)
        norm = float(total.sqrt())
        if max_norm > 0 and math.isfinite(norm):
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                for g in grads:
                    (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
        return norm

    def _copies(self, grad: torch.Tensor) -> int:
        shards = 1
        if isinstance(grad, DTensor):
            for dim, placement in enumerate(grad.placements):
                if placement.is_shard() or isinstance(placement, _StridedShard):
                    shards *= grad.device_mesh.size(dim)
        return self.ranks_per_stage // shards
