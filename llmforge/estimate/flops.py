"""FLOPs of llmforge's GPT: matmuls only (2 FLOPs per multiply-add), as
``torch.utils.flop_counter.FlopCounterMode`` counts them.

Conventions:

- attention scores are counted in full (s x s), not halved for the causal mask,
  as Narayanan et al. 2021 and the flop counter do; a document mask or sliding
  window scales them by the share of causal pairs it keeps (``Shape.attention_span``,
  llmforge.estimate.attention);
- *model* FLOPs are forward + backward = 3x forward (the MFU convention of
  PaLM / Megatron); embeddings, norms, softmax and elementwise ops are not counted;
- *hardware* FLOPs are what the kernels execute: the fused attention backward
  recomputes the score matrix (5 batched matmuls against the forward's 2), and
  activation recomputation adds forward work (full: the blocks; selective:
  nothing counted here, it keeps every matmul and attention output and reruns
  only elementwise work).
- MoE: a token runs through top_k routed experts plus the shared ones; with a
  capacity factor the estimate assumes balanced routing (no padding computed).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.choices import Activation, Recompute
from llmforge.estimate.inventory import Inventory
from llmforge.estimate.params import StageCounts
from llmforge.estimate.shape import Shape
from llmforge.layout import Layout


@dataclass(frozen=True)
class TokenFlops:
    """Forward FLOPs per token of one block, split by where they go."""

    weights: float
    attention: float

    @property
    def forward(self) -> float:
        return self.weights + self.attention


def _mlp(shape: Shape, ffn: int) -> float:
    return (3 if shape.activation == Activation.SWIGLU else 2) * 2 * shape.hidden * ffn


def block_flops(shape: Shape, *, moe: bool) -> TokenFlops:
    """Forward FLOPs per token of block: projections, attention core, MLP or experts."""
    h = shape.hidden
    proj = 2 * h * (2 * h + 2 * shape.kv_dim)
    if moe:
        routed = shape.top_k * min(1.0, shape.capacity_factor or 1.0)
        ffn = 2 * h * shape.num_experts + (routed + shape.shared_experts) * _mlp(shape, shape.moe_ffn)
    else:
        ffn = _mlp(shape, shape.ffn)
    return TokenFlops(weights=proj + ffn, attention=4 * shape.attention_span * h)


def head_flops(shape: Shape) -> float:
    """Forward FLOPs per token of the output projection (logits)."""
    return 2 * shape.hidden * shape.vocab


def _forward_per_token(shape: Shape) -> float:
    moe = shape.num_moe_layers
    dense = (shape.num_layers - moe) * block_flops(shape, moe=False).forward
    return dense + (moe * block_flops(shape, moe=True).forward if moe else 0.0) + head_flops(shape)


def forward_flops(shape: Shape, tokens: float) -> float:
    """Forward FLOPs of the whole model for ``tokens`` tokens."""
    return tokens * _forward_per_token(shape)


def backward_flops(shape: Shape, tokens: float) -> float:
    """Backward FLOPs as executed: 2x for weight matmuls, 2.5x for the fused attention core."""
    return tokens * _backward_per_token(shape)


def _backward_per_token(shape: Shape) -> float:
    def one(moe: bool) -> float:
        f = block_flops(shape, moe=moe)
        return 2 * f.weights + 2.5 * f.attention

    moe = shape.num_moe_layers
    return (shape.num_layers - moe) * one(False) + (moe * one(True) if moe else 0.0) + 2 * head_flops(shape)


def model_flops(shape: Shape, tokens: float) -> float:
    """Model FLOPs (3x forward), the numerator of MFU."""
    return 3 * forward_flops(shape, tokens)


def recompute_flops_per_token(shape: Shape, layout: Layout, index: int) -> float:
    """Extra forward FLOPs per token of block ``index`` caused by activation recomputation."""
    mode = layout.recompute
    if mode == Recompute.FULL and index % layout.recompute_every:
        mode = Recompute.NONE
    return recompute_extra(shape, moe=shape.is_moe_layer(index), mode=mode)


def recompute_extra(shape: Shape, *, moe: bool, mode: str) -> float:
    """Extra forward FLOPs per token of one block recomputed under ``mode``."""
    f = block_flops(shape, moe=moe)
    if mode == Recompute.FULL:
        return f.forward - _unrecomputed_tail(shape, moe=moe)
    return 0.0


def _unrecomputed_tail(shape: Shape, *, moe: bool) -> float:
    """The block's last matmul: its output is not needed by backward, so torch's
    non-reentrant checkpoint stops recomputing before it."""
    if not moe:
        return 2 * shape.hidden * shape.ffn
    # the shared MLP's down projection, when present; the experts' output is needed by the combine
    return 2 * shape.hidden * shape.moe_ffn * shape.shared_experts


def hardware_flops(shape: Shape, layout: Layout, tokens: float) -> float:
    """Forward + backward + recomputation FLOPs, as executed."""
    extra = _recompute_per_token(shape, layout.recompute, layout.recompute_every)
    return forward_flops(shape, tokens) + backward_flops(shape, tokens) + tokens * extra


def _recompute_per_token(shape: Shape, recompute: str, every: int) -> float:
    if recompute != Recompute.FULL:
        return 0.0  # selective recompute reruns no matmul
    recomputed = [shape.is_moe_layer(i) for i in range(0, shape.num_layers, every)]
    moe = sum(recomputed)
    return (len(recomputed) - moe) * recompute_extra(shape, moe=False, mode="full") + moe * recompute_extra(shape, moe=True, mode="full")


def stage_hardware_flops_per_token(inv: Inventory, counts: StageCounts) -> float:
    """Hardware FLOPs per token of one pipeline rank (before tensor/context splitting)."""
    return _stage_flops(inv.shape, inv.layout.recompute, counts)


def _stage_flops(shape: Shape, recompute: str, counts: StageCounts) -> float:
    def block(moe: bool, mode: str) -> float:
        f = block_flops(shape, moe=moe)
        return 3 * f.weights + 3.5 * f.attention + recompute_extra(shape, moe=moe, mode=mode)

    total = (
        counts.dense * block(False, Recompute.NONE)
        + counts.moe * block(True, Recompute.NONE)
        + counts.dense_ckpt * block(False, recompute)
        + counts.moe_ckpt * block(True, recompute)
    )
    if counts.last:
        total += 3 * head_flops(shape)
    return total


def weight_grad_share(shape: Shape) -> float:
    """Share of a block's forward FLOPs in weight matmuls (the zero-bubble W/F ratio)."""
    f = block_flops(shape, moe=shape.num_experts > 0)
    return f.weights / f.forward


def narayanan_flops(*, batch: int, seq: int, layers: int, hidden: int, vocab: int, full_recompute: bool = False) -> float:
    """Narayanan et al. 2021, FLOPs per iteration (f = 4h, MHA, GELU MLP)."""
    b, s, L, h, V = batch, seq, layers, hidden, vocab
    if full_recompute:
        return 96 * b * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
