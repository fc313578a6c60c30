"""Bytes saved for backward by llmforge's GPT, per microbatch.

The accounting follows the tensors the real model saves (checked in
tests/test_estimate_model.py with ``saved_tensors_hooks``), not a textbook
transformer. What matters about llmforge's GPT:

- the master weights are fp32; under bf16/fp16 the residual stream (and so the block
  input that recompute saves, the norm inputs and LayerNorm's statistics) is in the
  compute dtype, r bytes per element (``Job.residual_bytes``), or fp32 with
  ``precision.fp32_residual``; matmul inputs and outputs are 16-bit;
- RMSNorm on a CPU keeps an fp32 upcast of its input and its fp32 normalised input
  whatever the residual dtype (torch's composite ``rms_norm``); on a GPU its fused
  kernel keeps the input (in the residual dtype) and an fp32 statistic;
- with an fp32 residual stream autocast casts a norm output once per consuming
  linear (one for the fused q/k/v, one for the MLP's fused gate/up or up; an MoE layer's
  router and shared MLP: two); with a 16-bit one the linears share the norm's
  16-bit output;
- under ZeRO 0 autocast keeps a 16-bit copy of every matmul weight for backward, per
  microbatch (not of the weights of float8 linear layers under ``precision.fp8``,
  which keep their fp32 master weight and cast it again in backward);
- attention is ``scaled_dot_product_attention`` (a fused kernel): it keeps q, k, v
  (k and v at full head count after the GQA repeat), its output and the
  log-sum-exp, never the s x s score matrix;
- with RoPE the attention output is copied when heads are merged back;
- under ZeRO 1-3 (FSDP over more than one rank) with 16-bit compute the gathered
  weights are already 16-bit: autocast keeps no copies of them; with an fp32 residual
  stream expert weights pass through fp32 on their way into the batched matmuls, and
  each norm keeps fp32 copies of its 16-bit weight (and bias).

Tensor parallelism (DTensor, torchtitan style) splits everything between the
column- and row-parallel linears over tp; the norm region stays replicated unless
sequence parallel, and then the gathered norm output the linears save is full
size. Context parallel splits every per-token tensor over cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.choices import Activation, Norm, Position, Recompute
from llmforge.estimate.fp8 import converted
from llmforge.estimate.inventory import Inventory
from llmforge.estimate.params import StageCounts, Tensor, block_tensors
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout, selective_rebuilds

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one block keeps per microbatch: per token (local) and per microbatch (fixed)."""

    per_token: float
    fixed: float

    def total(self, tokens: float) -> float:
        return self.per_token * tokens + self.fixed


def _norm_bytes(shape: Shape, *, consumers: int, c: int, r: int, sp: float, shard: bool = False, cpu: bool = True) -> tuple[float, float]:
    """(replicated-or-SP-split bytes, bytes of the output the linears save) per token
    of one pre-norm over a residual stream of ``r`` bytes. The linears save the whole
    output (once per linear when autocast casts an fp32 one), or with ``shard``
    (sequence parallel) only its sequence shard, once, in the compute dtype."""
    h = shape.hidden
    if shape.norm == Norm.RMSNORM and not cpu:  # CUDA's fused kernel: the input and the fp32 statistic
        kept = h * r + FP32
    elif shape.norm == Norm.RMSNORM:  # fp32 input (upcast) and statistic, the normalised input for the weight gradient
        kept = 2 * h * FP32 + FP32
    else:
        kept = h * r + 2 * r  # input, mean and inverse deviation
    if shard:
        return kept / sp, h * c / sp
    casts = consumers if r != c else 1
    return kept / sp, casts * h * c  # the output the linears save


def _attention_bytes(shape: Shape, *, c: int, tp: int) -> float:
    """Per token, one tp rank: q, k, v for the fused kernel, its output and log-sum-exp."""
    h, a = shape.hidden, shape.heads
    out = h * c + (h * c if shape.position == Position.ROPE else 0) + a * FP32
    return (3 * h * c + out) / tp


def _mlp_bytes(shape: Shape, ffn: int, *, c: int, tp: int) -> float:
    """Per token: gelu keeps its input and output; swiglu gate, silu(gate), up and their product."""
    return (4 if shape.activation == Activation.SWIGLU else 2) * ffn * c / tp


def _selective_bytes(shape: Shape, *, c: int, r: int, tp: int, sp: int, moe: bool, gathered: bool = False, row_op: bool = False) -> float:
    """Selective recompute keeps the block input, every matmul and collective output,
    and the fused attention's output and log-sum-exp.

    Column-parallel outputs (fused q/k/v, fused gate/up or up) are split over tp. Under
    tp the reductions' outputs are kept too: all-reduced sums (full width), or with
    sequence parallel the reduce-scattered shard (the gather is inside the
    column-parallel op, whose outputs are kept; under async TP, ``gathered``, the gather
    is torch's collective before the linears and its whole-sequence output is kept too).
    The row-parallel outputs (o, down) before their reduction are partial sums of full
    width, which backward never reads: torch's ``RowwiseParallel`` makes them an op of
    their own, whose output is kept; with ``row_op`` (sequence parallel, neither async TP
    nor float8: ``llmforge.parallel.sequence.sp_row_linear``) the linear and its
    reduce-scatter are one op and only the shard is kept. Under TP + SP with ``row_op``
    a dense GELU block keeps (2 + 6 + 2 + 2 + 8 + 2) h/t = 22h/t bytes per token with a
    16-bit residual stream, and 4a/t of log-sum-exp.
    """
    h, kv = shape.hidden, shape.kv_dim
    collective = 0.0 if tp == 1 else (h / tp * c if sp > 1 else h * c)
    collective += h * c if gathered and sp > 1 else 0.0
    partial = 0.0 if row_op else h * c  # the row-parallel linear's output (its partial sum under tp)
    attention = (h * c + shape.heads * FP32) / tp
    attn = h * r / sp + (h + 2 * kv) / tp * c + partial + attention + collective
    if moe:
        return attn + _moe_selective_bytes(shape, c=c) / sp
    return attn + (2 if shape.activation == Activation.SWIGLU else 1) * shape.ffn / tp * c + partial + collective


def row_op(layout: Layout, job: Job) -> bool:
    """Whether the row-parallel linears run as one op with their reduce-scatter
    (``llmforge.parallel.tensor``: sequence parallel, not async TP, not float8)."""
    return layout.tp > 1 and layout.sequence_parallel and not layout.async_tp and not job.fp8


def _rebuilt_bytes(shape: Shape, *, c: int, r: int, cpu: bool) -> float:
    """Selective recompute of an eager dense block without tensor parallelism (``llmforge.parallel.rebuild``)
    keeps the block input, what each norm keeps besides its input (its statistics; on a CPU RMSNorm's
    fp32 normalised input and, from a 16-bit block input, the first norm's fp32 upcast), the fused q/k/v
    output, the attention's output and log-sum-exp, the output projection's output (the residual add's
    other input) and the first MLP linear's output. Rebuilt from these: the norms' outputs (and the
    casts of them autocast makes under an fp32 residual stream), the residual add between them, the
    queries taken out of their groups, RoPE, the GQA repeat, the heads' merge and the activation.
    Autograd's other saved tensors (autocast's weight copies, the RoPE tables) are kept as without
    recompute (``_fixed_bytes``)."""
    h, kv = shape.hidden, shape.kv_dim
    if shape.norm == Norm.RMSNORM and cpu:  # the first norm's upcast of a 16-bit block input (the second's is rebuilt)
        norms = 2 * (h * FP32 + FP32) + (h * FP32 if r != FP32 else 0)
    else:
        norms = 2 * (FP32 if shape.norm == Norm.RMSNORM else 2 * r)
    attention = h * c + shape.heads * FP32
    mlp = (2 if shape.activation == Activation.SWIGLU else 1) * shape.ffn * c
    return h * r + norms + (h + 2 * kv) * c + attention + h * c + mlp


def block_activations(shape: Shape, layout: Layout, job: Job, *, moe: bool, recompute: str) -> BlockActivations:
    """What one block saves for backward under ``recompute`` (none, selective or full)."""
    c, r, tp = job.compute_bytes, job.residual_bytes, layout.tp
    sp = tp if layout.sequence_parallel else 1
    if recompute == Recompute.FULL:
        return BlockActivations(per_token=shape.hidden * r / sp, fixed=0.0)
    if recompute == Recompute.SELECTIVE and selective_rebuilds(tp=tp, moe=moe, compiled=job.compile):
        return BlockActivations(per_token=_rebuilt_bytes(shape, c=c, r=r, cpu=job.on_cpu), fixed=_fixed_bytes(shape, layout, job, moe=moe))
    if recompute == Recompute.SELECTIVE:
        return BlockActivations(
            per_token=_selective_bytes(shape, c=c, r=r, tp=tp, sp=sp, moe=moe, gathered=layout.async_tp, row_op=row_op(layout, job)),
            fixed=4 * shape.num_experts if moe else 0.0,
        )
    attn_consumers, mlp_consumers = 1, 1  # the fused projections
    if moe:
        mlp_consumers = 1 + (1 if shape.shared_experts else 0)  # router, shared MLP
    shard = sp > 1 and not layout.async_tp  # async TP's linears save the gathered input
    kept1, out1 = _norm_bytes(shape, consumers=attn_consumers, c=c, r=r, sp=sp, shard=shard, cpu=job.on_cpu)
    kept2, out2 = _norm_bytes(shape, consumers=mlp_consumers, c=c, r=r, sp=sp, shard=shard and not moe, cpu=job.on_cpu)
    per_token = kept1 + out1 + kept2 + out2 + _attention_bytes(shape, c=c, tp=tp)
    per_token += _ffn_bytes(shape, layout, job, moe=moe)
    return BlockActivations(per_token=per_token, fixed=_fixed_bytes(shape, layout, job, moe=moe))


def _ffn_bytes(shape: Shape, layout: Layout, job: Job, *, moe: bool) -> float:
    c, tp = job.compute_bytes, layout.tp
    if not moe:
        return _mlp_bytes(shape, shape.ffn, c=c, tp=tp)
    sp = tp if layout.sequence_parallel else 1
    return moe_bytes(shape, c=c, r=job.residual_bytes) / sp


def _routed(shape: Shape) -> float:
    """Expert assignments per token under balanced routing (capacity can drop some)."""
    return shape.top_k * min(1.0, shape.capacity_factor or 1.0)


def moe_bytes(shape: Shape, *, c: int, r: int) -> float:
    """Per token of an MoE layer (replicated over tp) over a residual stream of ``r`` bytes:
    routing, dispatch buffer, experts, combine, shared MLP.

    Balanced routing: each expert's padded batch holds tokens x top_k / E rows."""
    mixed = c != FP32
    h, e, k, f = shape.hidden, shape.num_experts, _routed(shape), shape.moe_ffn
    swiglu = shape.activation == Activation.SWIGLU
    routing = 8 * e + 4 + 4 + (8 + 4 + 1 + 4 * INT64) * shape.top_k  # probs, logits, lse, norm sum, ids, weights, masks, indices
    if mixed:
        dispatch = (2 if swiglu and r != c else 1) * k * h * c  # an fp32 buffer is cast once per bmm
        combine = k * (h * c + h * FP32 + c)
    else:
        dispatch = k * h * FP32
        combine = k * (2 * h * FP32 + FP32)
    experts = (4 if swiglu else 2) * k * f * c
    shared = (4 if swiglu else 2) * f * shape.shared_experts * c
    return routing + dispatch + combine + experts + shared


def _moe_selective_bytes(shape: Shape, *, c: int) -> float:
    """Selective recompute of an MoE layer keeps router logits and every (b)mm output."""
    k, f = _routed(shape), shape.moe_ffn
    mats = 2 if shape.activation == Activation.SWIGLU else 1
    shared = (mats * f * shape.shared_experts + shape.hidden) * c if shape.shared_experts else 0
    return shape.num_experts * c + k * (mats * f + shape.hidden) * c + shared


def _sp_linear(t: Tensor, layout: Layout, *, moe: bool) -> bool:
    """A tensor-parallel weight a sequence-parallel op casts itself (no autocast copy): the
    column-parallel ones (an MoE layer's only in attention) and the row-parallel ones."""
    sp = layout.sequence_parallel and layout.tp > 1 and not layout.async_tp
    return sp and (t.split == "row" or (t.split == "col" and (not moe or t.name.startswith("attn."))))


def _norm_params(shape: Shape) -> int:
    """Weight (and LayerNorm bias) elements of one norm: what it keeps a copy of."""
    return shape.hidden * (2 if shape.norm == Norm.LAYERNORM and shape.bias else 1)


def weights_gathered(layout: Layout, job: Job) -> bool:
    """FSDP (ZeRO 1-3 over more than one rank) gathers the weights in the 16-bit compute dtype."""
    return job.mixed and layout.zero > 0 and layout.dp * layout.cp > 1


def _fixed_bytes(shape: Shape, layout: Layout, job: Job, *, moe: bool) -> float:
    """Per-microbatch bytes independent of the micro batch: autocast weight copies,
    copies of the norm weights in the residual dtype where it is not theirs, RoPE tables."""
    rope = 4 * shape.seq * (shape.head_dim // 2) * job.compute_bytes if shape.position == Position.ROPE and job.mixed else 0
    share = 4 * shape.num_experts if moe else 0  # the aux loss's per-expert load
    if not job.mixed:
        return share
    gathered, r = weights_gathered(layout, job), job.residual_bytes
    norms = 2 * _norm_params(shape) * r if gathered == (r == FP32) else 0.0
    return autocast_copies_bytes(shape, layout, job, moe=moe) + norms + rope + share


def autocast_copies_bytes(shape: Shape, layout: Layout, job: Job, *, moe: bool) -> float:
    """The 16-bit copies autocast casts of one block's matrix weights on this rank (none
    where FSDP gathers 16-bit weights, but expert weights under an fp32 residual stream)."""
    if not job.mixed:
        return 0.0
    gathered, r = weights_gathered(layout, job), job.residual_bytes
    weights = 0.0
    for t in block_tensors(shape, moe):
        if len(t.shape) < 2 or (job.fp8 and converted(t, shape, moe=moe)):  # Float8Linear keeps the fp32 master for backward
            continue
        if t.expert:
            weights += t.numel / layout.ep if not gathered or r == FP32 else 0.0
        elif not gathered and not _sp_linear(t, layout, moe=moe):
            weights += t.numel / (layout.tp if t.split != "rep" else 1)
    return weights * job.compute_bytes


def cached_copies_bytes(shape: Shape, layout: Layout, job: Job, counts: StageCounts) -> float:
    """Autocast's cache at the end of a forward: the weight copies of the recomputed blocks,
    which those blocks do not save (they cast again in backward) but which the cache holds
    until the forward's autocast region ends (the blocks that save everything count theirs
    in their activations, as do the dense blocks that selective recompute rebuilds)."""
    if layout.recompute == Recompute.NONE:
        return 0.0
    rebuilt = layout.recompute == Recompute.SELECTIVE and selective_rebuilds(tp=layout.tp, moe=False, compiled=job.compile)
    dense = 0.0 if rebuilt else counts.dense_ckpt * autocast_copies_bytes(shape, layout, job, moe=False)
    return dense + (counts.moe_ckpt * autocast_copies_bytes(shape, layout, job, moe=True) if counts.moe_ckpt else 0.0)


def logits_bytes(shape: Shape, layout: Layout, job: Job) -> float:
    """The logits of one microbatch on the last stage (its vocabulary shard under tp), in the
    compute dtype: the step holds them until its backward returns."""
    return layout.micro_batch_size * shape.seq / layout.cp * shape.vocab / layout.tp * job.compute_bytes


def embedding_bytes(shape: Shape, layout: Layout) -> float:
    """First stage, per microbatch: token ids (and position ids) kept by the embedding lookups."""
    b, s = layout.micro_batch_size, shape.seq // layout.cp
    return b * (s + 1) * INT64 + (s * INT64 if shape.position == Position.LEARNED else 0)


def output_bytes(shape: Shape, layout: Layout, job: Job) -> float:
    """Last stage, per microbatch: final norm, the head's input, what the loss keeps, targets.

    The chunked loss (``llmforge.train.loss``) keeps the logits in the compute
    dtype; the vocabulary-parallel loss under tensor parallelism keeps fp32
    log-probabilities of its vocabulary shard."""
    b, s, tp = layout.micro_batch_size, shape.seq // layout.cp, layout.tp
    sp = tp if layout.sequence_parallel else 1
    r = job.residual_bytes
    kept, out = _norm_bytes(shape, consumers=1, c=job.compute_bytes, r=r, sp=sp, cpu=job.on_cpu)
    loss = shape.vocab * job.compute_bytes if tp == 1 else shape.vocab * FP32 / tp
    per_token = kept + out + loss + INT64
    gathered = weights_gathered(layout, job)
    norm_copy = _norm_params(shape) * r if job.mixed and gathered == (r == FP32) else 0  # the final norm's weight (and bias)
    head_copy = shape.vocab * shape.hidden * job.compute_bytes / tp if job.mixed and not gathered else 0
    return b * s * per_token + norm_copy + head_copy + (0 if tp == 1 else FP32)


LOSS_CHUNK_ELEMENTS = 2**26  # llmforge.train.loss.CHUNK_ELEMENTS


def logits_peak_bytes(shape: Shape, layout: Layout, job: Job) -> float:
    """Transient at the loss. Chunked loss: the logits' gradient in the compute dtype
    and two fp32 chunks of temporaries. Vocabulary-parallel loss (tp > 1): the
    logits' fp32 copy and fp32 gradient besides the logits of the shard."""
    b, s, tp = layout.micro_batch_size, shape.seq // layout.cp, layout.tp
    if tp == 1:
        rows = min(b * s, max(1, LOSS_CHUNK_ELEMENTS // shape.vocab))
        return b * s * shape.vocab * job.compute_bytes + 2 * rows * shape.vocab * FP32
    per_token = shape.vocab / tp * (job.compute_bytes + (FP32 if job.mixed else 0) + FP32)
    return b * s * per_token


def layer_bytes(shape: Shape, layout: Layout, job: Job, index: int) -> float:
    """Saved bytes of block ``index`` for one microbatch under the layout's recompute mode."""
    mode = layout.recompute
    if mode == Recompute.FULL and index % layout.recompute_every:
        mode = Recompute.NONE
    acts = block_activations(shape, layout, job, moe=shape.is_moe_layer(index), recompute=mode)
    return acts.total(layout.micro_batch_size * shape.seq / layout.cp)


def recompute_working_bytes(inv: Inventory, job: Job) -> float:
    """Under recompute, backward rebuilds one block's activations at a time: this extra peak."""
    shape, layout = inv.shape, inv.layout
    if layout.recompute == Recompute.NONE:
        return 0.0
    moe = shape.num_experts > 0
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    kept = block_activations(shape, layout, job, moe=moe, recompute=layout.recompute)
    return block_activations(shape, layout, job, moe=moe, recompute="none").total(tokens) - kept.total(tokens) + kept.fixed


def stage_bytes_per_microbatch(inv: Inventory, job: Job, counts: StageCounts) -> float:
    """Saved bytes of one microbatch on a pipeline rank: its blocks, plus embedding ids or the output."""
    shape, layout = inv.shape, inv.layout
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    mode = layout.recompute
    total = 0.0
    for n, moe, applies in (
        (counts.dense, False, False),
        (counts.moe, True, False),
        (counts.dense_ckpt, False, True),
        (counts.moe_ckpt, True, True),
    ):
        if n:
            total += n * block_activations(shape, layout, job, moe=moe, recompute=mode if applies else "none").total(tokens)
    if counts.first:
        total += embedding_bytes(shape, layout)
    if counts.last:
        total += output_bytes(shape, layout, job)
    return total
