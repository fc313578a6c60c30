"""Bytes saved for backward by llmforge's GPT, per microbatch.

The accounting follows the tensors the real model saves (checked in
tests/test_estimate_model.py with ``saved_tensors_hooks``), not a textbook
transformer. What matters about llmforge's GPT:

- weights are fp32 and bf16/fp16 runs use autocast, so the residual stream, the
  norm inputs and statistics stay fp32 while matmul inputs and outputs are 16-bit;
- autocast casts a norm output once per consuming linear (q, k, v: three copies)
  and keeps a 16-bit copy of every matmul weight for backward, per microbatch;
- attention is ``scaled_dot_product_attention`` (a fused kernel): it keeps q, k, v
  (k and v at full head count after the GQA repeat), its output and the
  log-sum-exp, never the s x s score matrix;
- with RoPE the attention output is copied when heads are merged back.

Tensor parallelism (DTensor, torchtitan style) splits everything between the
column- and row-parallel linears over tp; the norm region stays replicated unless
sequence parallel, and then the gathered norm output the linears save is full
size. Context parallel splits every per-token tensor over cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.estimate.params import matmul_weight_numel
from llmforge.estimate.shape import Job, Layout, Shape

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one block keeps per microbatch: per token (local) and per microbatch (fixed)."""

    per_token: float
    fixed: float

    def total(self, tokens: float) -> float:
        return self.per_token * tokens + self.fixed


def _norm_bytes(shape: Shape, *, consumers: int, c: int, mixed: bool, sp: float) -> tuple[float, float]:
    """(replicated-or-SP-split bytes, gathered bytes) per token of one pre-norm."""
    h = shape.hidden
    kept = h * FP32 + (FP32 if shape.norm == "rmsnorm" else 2 * FP32)  # input and statistics
    if shape.norm == "rmsnorm":
        kept += h * FP32  # the normalised input, kept for the weight gradient
    out = consumers * h * c if mixed else h * FP32  # the output each linear saves
    return kept / sp, out


def _attention_bytes(shape: Shape, *, c: int, tp: int) -> float:
    """Per token, one tp rank: q, k, v for the fused kernel, its output and log-sum-exp."""
    h, a = shape.hidden, shape.heads
    out = h * c + (h * c if shape.position == "rope" else 0) + a * FP32
    return (3 * h * c + out) / tp


def _mlp_bytes(shape: Shape, ffn: int, *, c: int, tp: int) -> float:
    """Per token: gelu keeps its input and output; swiglu gate, silu(gate), up and their product."""
    return (4 if shape.activation == "swiglu" else 2) * ffn * c / tp


def _selective_bytes(shape: Shape, ffn: int, *, c: int, tp: int, sp: int, moe: bool) -> float:
    """Selective recompute keeps the block input and every matmul output; the rest is rebuilt.

    Column-parallel outputs (q, k, v, gate, up) are split over tp; row-parallel
    outputs (o, down) are partial sums of full width before their reduction.
    """
    h, kv = shape.hidden, shape.kv_dim
    col = (h + 2 * kv + (2 if shape.activation == "swiglu" else 1) * ffn * (shape.top_k + shape.shared_experts if moe else 1)) / tp
    row = 2 * h
    return h * FP32 / sp + (col + row) * c


def block_activations(shape: Shape, layout: Layout, job: Job, *, moe: bool, recompute: str) -> BlockActivations:
    """What one block saves for backward under ``recompute`` (none, selective or full)."""
    c, mixed, tp = job.compute_bytes, job.mixed, layout.tp
    sp = tp if layout.sequence_parallel else 1
    if recompute == "full":
        return BlockActivations(per_token=shape.hidden * FP32 / sp, fixed=0.0)
    if recompute == "selective":
        ffn = shape.moe_ffn if moe else shape.ffn
        return BlockActivations(per_token=_selective_bytes(shape, ffn, c=c, tp=tp, sp=sp, moe=moe), fixed=0.0)
    attn_consumers, mlp_consumers = 3, 2 if shape.activation == "swiglu" else 1
    kept1, out1 = _norm_bytes(shape, consumers=attn_consumers, c=c, mixed=mixed, sp=sp)
    kept2, out2 = _norm_bytes(shape, consumers=mlp_consumers, c=c, mixed=mixed, sp=sp)
    per_token = kept1 + out1 + kept2 + out2 + _attention_bytes(shape, c=c, tp=tp)
    per_token += _ffn_bytes(shape, layout, job, moe=moe)
    return BlockActivations(per_token=per_token, fixed=_fixed_bytes(shape, layout, job, moe=moe))


def _ffn_bytes(shape: Shape, layout: Layout, job: Job, *, moe: bool) -> float:
    c, tp = job.compute_bytes, layout.tp
    if not moe:
        return _mlp_bytes(shape, shape.ffn, c=c, tp=tp)
    routed = shape.top_k * (shape.capacity_factor or 1.0)
    experts = routed + shape.shared_experts
    router = shape.num_experts * FP32 * 2  # router logits and probabilities
    # dispatch copies of the hidden states routed to experts (and their combine weights)
    dispatch = routed * (shape.hidden * c + FP32)
    return experts * _mlp_bytes(shape, shape.moe_ffn, c=c, tp=tp) + router + dispatch


def _fixed_bytes(shape: Shape, layout: Layout, job: Job, *, moe: bool) -> float:
    """Per-microbatch bytes independent of the micro batch: autocast weight copies, RoPE tables."""
    if not job.mixed:
        return 0.0
    weights = matmul_weight_numel(shape, moe) * job.compute_bytes / layout.tp
    if moe and layout.ep > 1:
        weights -= _expert_weight_numel(shape) * (1 - 1 / layout.ep) * job.compute_bytes / layout.tp
    rope = 4 * shape.seq * (shape.head_dim // 2) * job.compute_bytes if shape.position == "rope" else 0
    return weights + rope


def _expert_weight_numel(shape: Shape) -> int:
    per_expert = (3 if shape.activation == "swiglu" else 2) * shape.hidden * shape.moe_ffn
    return shape.num_experts * per_expert


def embedding_bytes(shape: Shape, layout: Layout) -> float:
    """First stage, per microbatch: token ids (and position ids) kept by the embedding lookups."""
    b, s = layout.micro_batch, shape.seq // layout.cp
    return b * (s + 1) * INT64 + (s * INT64 if shape.position == "learned" else 0)


def output_bytes(shape: Shape, layout: Layout, job: Job) -> float:
    """Last stage, per microbatch: final norm, the head's input, fp32 log-probabilities, targets."""
    b, s, tp = layout.micro_batch, shape.seq // layout.cp, layout.tp
    sp = tp if layout.sequence_parallel else 1
    kept, out = _norm_bytes(shape, consumers=1, c=job.compute_bytes, mixed=job.mixed, sp=sp)
    per_token = kept + out + shape.vocab * FP32 / tp + INT64
    head_copy = shape.vocab * shape.hidden * job.compute_bytes / tp if job.mixed else 0
    return b * s * per_token + head_copy + FP32


def logits_peak_bytes(shape: Shape, layout: Layout, job: Job) -> float:
    """Transient at the loss: the logits, their fp32 copy and the logits' gradient."""
    b, s, tp = layout.micro_batch, shape.seq // layout.cp, layout.tp
    per_token = shape.vocab / tp * (job.compute_bytes + (FP32 if job.mixed else 0) + FP32)
    return b * s * per_token


def layer_bytes(shape: Shape, layout: Layout, job: Job, index: int) -> float:
    """Saved bytes of block ``index`` for one microbatch under the layout's recompute mode."""
    mode = layout.recompute
    if mode == "full" and index % layout.recompute_every:
        mode = "none"
    acts = block_activations(shape, layout, job, moe=shape.is_moe_layer(index), recompute=mode)
    return acts.total(layout.micro_batch * shape.seq / layout.cp)


def recompute_working_bytes(shape: Shape, layout: Layout, job: Job) -> float:
    """Under recompute, backward rebuilds one block's activations at a time: this extra peak."""
    if layout.recompute == "none":
        return 0.0
    moe = shape.num_experts > 0
    full = block_activations(shape, layout, job, moe=moe, recompute="none")
    kept = block_activations(shape, layout, job, moe=moe, recompute=layout.recompute)
    tokens = layout.micro_batch * shape.seq / layout.cp
    return full.total(tokens) - kept.per_token * tokens
