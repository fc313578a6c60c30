"""Tied input/output embeddings across pipeline stages (as Megatron-LM does).

With ``model.tie_embeddings`` and pp > 1 the first stage holds ``embed.weight``
and the last stage a copy of it as ``head.weight``, initialised to the same
values. After backward both gradients are replaced by their sum (the gradient
of the one shared matrix), so identical optimizer updates keep the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from llmforge.parallel.dtensor import local
from llmforge.parallel.mesh import ParallelMesh


@dataclass
class TiedEmbeddingSync:
    """Sum the gradients of the tied copies held on this rank and its partner rank.

    ``group`` is None when both copies live on this rank (the V-shaped schedule
    puts the first and last chunk on pipeline rank 0)."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None

    def __call__(self) -> None:
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            g.copy_(total)


def tied_group(mesh: ParallelMesh, *, first_pp: int, last_pp: int) -> dist.ProcessGroup | None:
    """The group of the two pipeline ranks holding the tied copies, for this rank's
    data/tensor coordinates. Every rank takes part in creating every group."""
    if first_pp == last_pp:
        return None
    ranks = mesh.world.mesh  # [pp, dp_replicate, dp_shard, ep, cp, tp]
    mine = None
    flat_first = ranks[first_pp].reshape(-1).tolist()
    flat_last = ranks[last_pp].reshape(-1).tolist()
    me = dist.get_rank()
    for a, b in zip(flat_first, flat_last, strict=False):
        group = dist.new_group([a, b])
        if me in (a, b):
            mine = group
    return mine


def tied_params(parts: list[nn.Module], *, first: bool, last: bool) -> list[nn.Parameter]:
    """This rank's copies of the tied matrix: ``embed.weight`` on the first chunk,
    ``head.weight`` on the last."""
    out = []
    for part in parts:
        if first and getattr(part, "embed", None) is not None:
            out.append(part.embed.weight)
        if last and getattr(part, "head", None) is not None:
            out.append(part.head.weight)
    return out
