"""Context parallelism: every rank of a cp group holds a slice of each sequence.

- Sharding (load-balanced for causal attention): the sequence is cut into
  ``2 x cp`` equal chunks and cp rank ``r`` holds chunks ``r`` and ``2cp-1-r``,
  so every rank has the same amount of causal attention work. Inputs and targets
  are sharded after the next-token shift, with the same positions.
- The model gets the global positions of its tokens (``GPT.forward(positions=)``)
  for learned position embeddings and RoPE.
- Attention: keys and values are all-gathered over the cp group (backward
  reduce-scatters their gradients back to the rank that computed them), and the
  local queries attend to the whole sequence under a causal mask built from global
  positions. Everything else (norms, MLP, the loss) is per token and stays local.
- Document masks and sliding windows: the model builds a dense mask of its local
  queries against the whole window in sequence order (``llmforge.models.masks``);
  the gathered keys and values are put back in that order before attention.
- Each rank's loss is the mean over its tokens, which are as many on every rank,
  so the mean over dp x cp ranks is the global mean; gradients are averaged over
  the flattened dp x cp mesh (ZeRO 0 all-reduce or the FSDP mesh).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from llmforge.models.layers import Attention


def cp_positions(*, seq_len: int, cp_rank: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions held by ``cp_rank``: chunks ``r`` and ``2cp-1-r`` of ``2cp``."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, last])


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of ``[b, heads, s, d]``) in rank order;
    backward sums the gradient of every rank's copy and keeps this rank's part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if grad.device.type == "cpu":  # gloo (CPU tensors) has no reduce-scatter
            total = grad.contiguous().clone()
            dist.all_reduce(total, group=group)
            return total.chunk(size, dim=2)[rank].contiguous(), None
        chunks = [c.contiguous() for c in grad.chunk(size, dim=2)]
        out = torch.empty_like(chunks[rank])
        dist.reduce_scatter(out, chunks, group=group)
        return out, None


def gather_sequence(x: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd-aware all-gather of ``[b, heads, s_local, d]`` over the cp group."""
    return _GatherSeq.apply(x, group)


def cp_core_attention(self: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> torch.Tensor:
    """Local queries against the whole sequence's keys and values, causal by global position.
    ``mask`` (document or sliding-window attention): the model's dense mask of the local
    queries against the keys in global order, into which the gathered keys are put back."""
    group, cp, rank = self.cp_group, self.cp_size, self.cp_rank
    seq = q.shape[2] * cp
    k, v = gather_sequence(k, group=group), gather_sequence(v, group=group)
    if k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    k_pos = torch.cat([cp_positions(seq_len=seq, cp_rank=r, cp=cp, device=q.device) for r in range(cp)])
    if mask is not None:
        order = torch.argsort(k_pos)
        k, v = k.index_select(2, order), v.index_select(2, order)
    else:
        q_pos = cp_positions(seq_len=seq, cp_rank=rank, cp=cp, device=q.device)
        mask = q_pos[:, None] >= k_pos[None, :]
    dropout = self.dropout if self.training else 0.0
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)


def apply_cp(model: nn.Module, *, cp_mesh: DeviceMesh) -> None:
    """Make every attention layer of ``model`` (a GPT or a chunk of it) context parallel."""
    group = cp_mesh.get_group()
    for module in model.modules():
        if isinstance(module, Attention):
            module.cp_group, module.cp_size, module.cp_rank = group, cp_mesh.size(), cp_mesh.get_local_rank()
            module.core_attention = types.MethodType(cp_core_attention, module)
