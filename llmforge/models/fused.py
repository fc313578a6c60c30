"""Fused projections: q, k and v are one linear (``attn.qkv_proj``), SwiGLU's gate and up
another (``mlp.gate_up_proj``), one matmul each instead of three and two.

The fused weight's rows come in ``groups`` blocks, and block ``g`` holds block ``g`` of
each part in turn: ``[q heads of KV group g, k head g, v head g]`` for attention (the
layout of Megatron-LM's ``linear_qkv``), ``[gate rows of block g, up rows of block g]``
for the MLP. Every tensor-parallel degree the plan allows divides ``groups`` (tp divides
``num_kv_heads`` and ``ffn_hidden_size``), so torch's plain row split (``ColwiseParallel``,
``Shard(0)``) gives each rank whole blocks: its own q heads with the k and v heads of their
groups, and matching gate and up rows; each rank splits its output by local sizes. The
order depends on the model alone, never on the layout, so checkpoints reshard by name.

The unfused names (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``) remain
the parts: initial values are drawn per part name (the values of the unfused model), and
Hugging Face names map to the parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from llmforge.blockspec.block import FUSED
from llmforge.blockspec.dims import dims_of
from llmforge.blockspec.dims import gate_up_groups as blockspec_gate_up_groups
from llmforge.config.schema import ModelConfig


def kv_groups(config: ModelConfig) -> int:
    """Blocks of ``qkv_proj``: one per KV head."""
    return config.num_kv_heads or config.num_heads


def gate_up_groups(config: ModelConfig, *, ffn: int) -> int:
    """Blocks of a ``gate_up_proj`` of width ``ffn`` (``llmforge.blockspec.dims.gate_up_groups``)."""
    return blockspec_gate_up_groups(dims_of(config), ffn=ffn)


def parts_of(name: str) -> list[str] | None:
    """The unfused names a fused parameter stands for
    (``layers.0.attn.qkv_proj.weight`` -> ``layers.0.attn.q_proj.weight``, ...); None if not fused."""
    prefix, _, rest = name.rpartition(".")
    module, _, linear = prefix.rpartition(".")
    if linear not in FUSED:
        return None
    head = f"{module}." if module else ""
    return [f"{head}{part}.{rest}" for part in FUSED[linear]]


def layout_of(config: ModelConfig, *, name: str, rows: int) -> tuple[list[int], int]:
    """(rows of each part, groups) of the fused parameter ``name`` with ``rows`` rows."""
    if ".qkv_proj." in f".{name}":
        head_dim = config.hidden_size // config.num_heads
        kv = kv_groups(config) * head_dim
        return [rows - 2 * kv, kv, kv], kv_groups(config)
    ffn = rows // 2
    return [ffn, ffn], gate_up_groups(config, ffn=ffn)


def fuse(parts: Sequence[torch.Tensor], *, groups: int) -> torch.Tensor:
    """The fused tensor of ``parts`` (rows along dim 0): block g of each part in turn, for each g."""
    return torch.cat([p.unflatten(0, (groups, -1)) for p in parts], dim=1).flatten(0, 1)


def unfuse(tensor: torch.Tensor, *, sizes: Sequence[int], groups: int) -> list[torch.Tensor]:
    """The parts of a fused tensor (``fuse`` read backwards), each of ``sizes[i]`` rows."""
    blocks = tensor.unflatten(0, (groups, -1)).split([s // groups for s in sizes], dim=1)
    return [b.flatten(0, 1) for b in blocks]


def unfused_parts(names: Iterable[str]) -> dict[str, list[str]]:
    """Fused parameter name -> its parts, for each fused parameter whose parts are all
    among ``names`` (parameters of a model saved before llmforge fused its projections)."""
    names = set(names)
    out = {}
    for name in names:
        module, _, rest = name.rpartition(".")
        parent, _, linear = module.rpartition(".")
        for fused, parts in FUSED.items():
            candidate = f"{parent}.{fused}.{rest}" if parent else f"{fused}.{rest}"
            if linear == parts[0] and all(p in names for p in parts_of(candidate) or ()):
                out[candidate] = parts_of(candidate)
    return out


def fuse_saved(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Whole weights by name with the unfused parts of a model saved before fused
    projections replaced by the fused tensors (any other weights kept as they are)."""
    out = dict(weights)
    for fused, parts in unfused_parts(weights).items():
        values = [out.pop(p) for p in parts]
        _, groups = layout_of(config, name=fused, rows=sum(v.shape[0] for v in values))
        out[fused] = fuse(values, groups=groups)
    return out
