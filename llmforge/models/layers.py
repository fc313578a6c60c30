"""The layers a block is made of: norms, rotary positions, attention, the MLP."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmforge.blockspec.block import Linear as LinearSpec
from llmforge.blockspec.block import Norm as NormSpec
from llmforge.blockspec.block import describe
from llmforge.blockspec.dims import dims_of
from llmforge.config.schema import ModelConfig
from llmforge.models.rebuild import rebuildable


def _like(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return weight if weight is None or weight.dtype == x.dtype else weight.to(x.dtype)


def _in_input_dtype(x: torch.Tensor):
    """No autocast for a 16-bit input: the norm kernels take it as it is and
    accumulate in fp32, return its dtype and keep it (not an fp32 copy) for backward."""
    if x.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


class LayerNorm(nn.LayerNorm):
    """LayerNorm in the residual stream's dtype (the input's): the weights are cast
    to it (16-bit weights gathered by FSDP to an fp32 stream, fp32 weights to a
    16-bit one) and the output has it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _in_input_dtype(x):
            return F.layer_norm(x, self.normalized_shape, _like(self.weight, x), _like(self.bias, x), self.eps)


class RMSNorm(nn.RMSNorm):
    """RMSNorm in the input's dtype (see ``LayerNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _in_input_dtype(x):
            return F.rms_norm(x, self.normalized_shape, _like(self.weight, x), self.eps)


def make_norm(spec: NormSpec, *, eps: float) -> nn.Module:
    """The norm a description lists (``llmforge.blockspec``): RMSNorm, or LayerNorm with or without bias."""
    if spec.kind == "rmsnorm":
        return RMSNorm(spec.size, eps=eps)
    return LayerNorm(spec.size, eps=eps, bias=spec.bias)


def rope_tables(*, head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, head_dim/2] (rotation of consecutive halves)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, heads, s, d] by position (the 'rotate half' convention of Llama/GPT-NeoX).
    ``cos``/``sin``: [s, d/2] shared by the rows, or [b, s, d/2] per row (positions restarting at documents)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if cos.dim() == 3:
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    else:
        cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def linear(spec: LinearSpec) -> nn.Linear:
    """The ``nn.Linear`` a block description lists (``llmforge.blockspec``)."""
    return nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)


class Attention(nn.Module):
    """Multi-head attention; ``windowed``: this layer uses ``model.sliding_window``.
    q, k and v are one linear, its rows grouped by KV head (``llmforge.models.fused``);
    sizes and names as the block description lists them (``llmforge.blockspec``)."""

    def __init__(self, config: ModelConfig, *, windowed: bool = False) -> None:
        super().__init__()
        spec = describe(dims_of(config))
        qkv = spec.linear("attn.qkv_proj")
        self.windowed = windowed
        self.head_dim = config.hidden_size // config.num_heads
        self.q_per_group = config.num_heads // qkv.groups
        self.qkv_proj = linear(qkv)
        self.o_proj = linear(spec.linear("attn.o_proj"))
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: Any = None, cache: Any = None) -> torch.Tensor:
        """``cache`` (generation): a ``llmforge.models.kvcache.LayerCache`` the new keys and values join."""
        b, s, _ = x.shape
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v, mask = cache.extend(k, v)
        out = self.core_attention(q, k, v, mask)
        return self.o_proj(rebuildable(merge_heads, out))

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [b, heads, s, head_dim], rotated when ``rope`` is given."""
        # [b, s, local KV groups, q heads of a group + k + v, head_dim]
        groups = self.qkv_proj(x).unflatten(-1, (-1, self.q_per_group + 2, self.head_dim))
        q, k, v = groups.split([self.q_per_group, 1, 1], dim=-2)
        k, v = k.squeeze(-2).transpose(1, 2), v.squeeze(-2).transpose(1, 2)
        if rope is None:
            return rebuildable(query_heads, q), k, v
        return rebuildable(query_heads, q, *rope), rebuildable(apply_rope, k, *rope), v

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> torch.Tensor:
        """Softmax attention; grouped-query heads share keys and values. ``mask``: None (causal),
        a boolean tensor (True = attend) or a FlexAttention block mask (``llmforge.models.masks``)."""
        if mask is not None and not isinstance(mask, torch.Tensor):
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        if k.shape[1] != q.shape[1]:
            groups = q.shape[1] // k.shape[1]
            k, v = rebuildable(repeat_heads, k, groups), rebuildable(repeat_heads, v, groups)
        dropout = self.dropout if self.training else 0.0
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)


def query_heads(groups: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """The queries [b, s, KV groups, q heads of a group, d] -> [b, heads, s, d] (a copy when there are
    several groups), rotated when ``cos`` and ``sin`` are given."""
    q = groups.flatten(2, 3).transpose(1, 2)
    return q if cos is None or sin is None else apply_rope(q, cos, sin)


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """Attention output [b, heads, s, d] -> [b, s, heads x d] (a copy unless the layout allows a view)."""
    b, _, s, _ = out.shape
    return out.transpose(1, 2).reshape(b, s, -1)


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Each KV head [b, kv heads, s, d] repeated for the ``groups`` query heads that share it."""
    return x.repeat_interleave(groups, dim=1)


_COMPILED_FLEX: list = []


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """FlexAttention compiled once per process (eager FlexAttention materialises the scores)."""
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention as flex

        _COMPILED_FLEX.append(torch.compile(flex, dynamic=False))
    return _COMPILED_FLEX[0](q, k, v, **kwargs)


class MLP(nn.Module):
    """GELU: down(gelu(up x)). SwiGLU: down(silu(gate x) * up x), gate and up one linear
    whose rows alternate in ``groups`` blocks (``llmforge.models.fused``). ``linears``: the
    first linear (``up_proj`` or ``gate_up_proj``) and ``down_proj`` of a block description."""

    def __init__(self, linears: list[LinearSpec]) -> None:
        super().__init__()
        first, down = linears
        swiglu = first.leaf == "gate_up_proj"
        self.block = first.out_features // 2 // first.groups
        self.gate_up_proj = linear(first) if swiglu else None
        self.up_proj = None if swiglu else linear(first)
        self.down_proj = linear(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).unflatten(-1, (-1, 2, self.block)).unbind(-2)
            return self.down_proj(rebuildable(gated, rebuildable(F.silu, gate), up))
        return self.down_proj(rebuildable(gelu, self.up_proj(x)))


def gated(activated: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product silu(gate) * up [..., groups, block], its blocks put back in one row."""
    return (activated * up).flatten(-2)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")
