"""What each op of a block costs on a GPU: kernels launched and bytes moved per token, forward
and backward. One entry per place in the model code that runs memory-bound work (the module
named in ``where``): ``eager_ops`` as the eager step runs them, ``compiled_ops`` as a compiled
block's fused regions, ``ends_ops`` outside the blocks; matmuls and attention are costed from the
block's linears and its attention by ``llmforge.estimate.kernels``.

Bytes follow llmforge's GPT as it runs with an fp32 residual stream: the residual stream and
norms in fp32 (4 bytes), matmul inputs in the compute dtype (``c`` bytes) under autocast, norms
and residual adds on a sequence shard under sequence parallelism (``sp``), the rest on this rank's
heads and MLP columns (``tp``). With the residual stream in the compute dtype (the default under
16-bit compute) a run casts the norms' weights instead of their outputs and no branch gradient,
which these costs do not follow yet. ``tests/test_kernel_count.py`` holds the eager kernel counts
to the profiled model.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.blockspec.block import Block
from llmforge.blockspec.dims import ModelDims, head_dim
from llmforge.config.choices import Activation, Position

FP32 = 4
#: Kernels of fused (flash) attention: forward, backward.
ATTENTION_KERNELS = (1, 3)


@dataclass(frozen=True)
class Op:
    """``count`` times: ``fwd_kernels`` kernels moving ``fwd_bytes`` per token forward, and
    ``bwd_kernels`` kernels moving ``bwd_bytes`` backward."""

    name: str
    where: str
    fwd_kernels: int
    bwd_kernels: int
    fwd_bytes: float
    bwd_bytes: float
    count: int = 1
    #: bytes moved once per microbatch besides the per-token ones (forward, backward)
    once: tuple[float, float] = (0.0, 0.0)
    #: how many of ``count`` an eager selective recompute runs again in backward: the steps the
    #: model marks rebuildable (``llmforge.models.rebuild``), whose outputs it does not keep
    rebuilt: int = 0


def _attention_ops(block: Block, d: ModelDims, *, tp: int, c: int, mixed: bool) -> list[Op]:
    q, kv = d.hidden / tp, d.kv_heads * head_dim(d) / tp
    out = []
    if block.position == Position.ROPE:
        # q and k: four products, a difference, a sum and a concatenation each (and under autocast
        # the cos and sin rows cast to the compute dtype for each); backward the products'
        # gradients, the halves put back (slice backward) and summed
        rope = Op("rope", "models.layers.apply_rope", 14 + 4 * mixed, 20, 9 * c * (q + kv), 14 * c * (q + kv) + 2 * c * q, rebuilt=1)
        out.append(rope)
        # attention then returns [b, heads, s, d]-strided output: o_proj's input is a copy
        out.append(Op("attention output copy", "models.layers.merge_heads", 1, 0, 2 * c * q, 0, rebuilt=1))
    if block.attention == "gqa":
        out.append(Op("repeat k and v", "models.layers.repeat_heads", 2, 2, 2 * c * (kv + q), 2 * c * (kv + q), rebuilt=1))
        if d.kv_heads > tp:  # q heads of several KV groups are copied out of the fused output
            out.append(Op("gather q heads", "models.layers.query_heads", 1, 0, 2 * c * q, 0, rebuilt=1))
    return out


def _activation(activation: str, *, name: str, f: float, c: int, rebuilt: int = 0) -> Op:
    """The activation between an MLP's matmuls over ``f`` columns per token."""
    where = "models.layers.MLP / models.moe.expert_mlp"
    if activation == Activation.SWIGLU:  # silu(gate) * up; backward silu's, and the product's two
        return Op(f"{name} swiglu", where, 2, 3, 5 * c * f, 9 * c * f, rebuilt=rebuilt)
    return Op(f"{name} gelu", where, 1, 1, 2 * c * f, 3 * c * f, rebuilt=rebuilt)


def _mlp_ops(block: Block, d: ModelDims, *, tp: int, c: int, mixed: bool) -> list[Op]:
    if block.experts is None:
        return [_activation(block.activation, name="mlp", f=d.ffn / tp, c=c, rebuilt=1)]
    out = [_activation(block.activation, name="experts", f=d.top_k * d.moe_ffn, c=c)]  # MoE layers are not split over tp
    if d.shared_experts:
        out.append(_activation(block.activation, name="shared experts", f=d.shared_experts * d.moe_ffn, c=c))
    return out + _moe_ops(block, d, c=c, mixed=mixed)


def _moe_ops(block: Block, d: ModelDims, *, c: int, mixed: bool) -> list[Op]:
    """Routing, dispatch into the experts' batches and the weighted combine, and the router's
    losses, in training (``models.moe.MoE.forward``; the default ``balance=aux`` and
    ``normalize_top_k``). Backward counts the sums of a gradient that several ops read."""
    shared, gated, capacity = d.shared_experts > 0, block.activation == Activation.SWIGLU, d.capacity_factor is not None
    normalize = d.top_k > 1  # weights / their sum: the division's backward and the sum's accumulation
    # softmax, top-k, (normalize), the kept mask: ones, or under capacity the choices made choice-major
    # (a copy when top_k > 1), one-hot, cumsum, less one, gather, compare; backward softmax's, top-k's,
    # and two sums (probs: read by top-k and the aux loss; logits: by softmax and the z-loss)
    keep = 5 + (d.top_k > 1) if capacity else 1
    route = Op("moe route", "models.moe.route", 2 + 2 * normalize + keep, 4 + 7 * normalize, 0, 0)
    # the assignments' tokens, the sort by expert, tokens and weights in that order, the counts and
    # their offsets for the grouped matmuls, the gathered tokens (under capacity also the kept
    # assignments: three masked selections); backward the gathers' scatters and sums of the tokens'
    # gradient (router, experts, shared experts) and the sorted input's (gate and up)
    moved = d.top_k * d.hidden * (c + FP32) * 2 + 16 * block.experts.num if block.experts else 0.0
    fwd, bwd = 9 + 3 * capacity, 3 + gated + shared + 2 * capacity
    dispatch = Op("moe dispatch", "models.moe.MoE._dispatch_combine, expert_mlp", fwd, bwd, moved, 2 * moved)
    # unpack, weight, scatter-add back to the tokens (plus the shared experts' output)
    combine = Op("moe combine", "models.moe.MoE._run_experts", 4 + shared, 6, 0, 0)
    # load balancing loss (the counts cast to float), z-loss, their weighted sum, and the statistics
    # added to the step's (a forward after the first since they were read); backward the losses'
    losses = Op("moe router losses", "models.moe.load_balancing_loss, z_loss, MoEStats.add", 24, 13, 0, 0)
    out = [route, dispatch, combine, losses]
    if mixed:
        # autocast's casts (each cast back in backward): the router's logits to fp32, the sorted tokens
        # for the experts' matmuls, the combine weights and the experts' output, and the
        # normed tokens once more for the shared experts (a second linear reads them); backward also
        # the shared experts' output gradient, added to the layer's fp32 output
        k, h = d.top_k, d.hidden
        casts = 4 + shared
        moved = (FP32 + c) * (block.experts.num if block.experts else 0) + (FP32 + c) * k * (2 * h + 1)
        moved += (FP32 + c) * h * shared
        out.append(Op("moe casts", "autocast", casts, casts + shared, moved, moved + (FP32 + c) * h * shared))
    return out


def _linear_ops(block: Block, *, tp: int, c: int) -> list[Op]:
    """Backward of the linears: a fused output's gradient put together from its parts'
    (one kernel per fused linear), and each bias's gradient (a sum over tokens)."""
    out = []
    for x in block.linears:
        rows = x.out_features / tp if x.split == "col" else x.out_features
        if x.parts:
            out.append(Op(f"{x.name} gradient of the parts", "models.layers", 0, 1, 0, 2 * c * rows))
        if x.bias:
            out.append(Op(f"{x.name} bias gradient", "nn.Linear", 0, 1, 0, c * rows))
    return out


def eager_ops(block: Block, d: ModelDims, *, tp: int, sp: int, c: int, mixed: bool) -> list[Op]:
    """The memory-bound ops of one eager block; ``mixed``: autocast to ``c`` bytes over fp32
    weights and residual stream."""
    h = d.hidden
    cast = (FP32 + c) * h
    ops = [
        Op("norm", "models.layers.make_norm", 1, 2, 8 * h / sp, 20 * h / sp, count=len(block.norms), rebuilt=len(block.norms)),
        # forward x + branch; backward the residual gradient and the branch's summed (the first add feeds
        # the second norm and is rebuilt; the block's output is not)
        Op("residual add", "models.gpt.Block.forward", 1, 1, (FP32 + c + FP32) * h / sp, 12 * h / sp, count=2, rebuilt=1),
    ]
    if mixed:
        ops += [
            # autocast casts each norm output once for the linear that reads it, and the gradient back
            Op("norm output cast", "autocast", 1, 1, cast, cast, count=len(block.norms), rebuilt=len(block.norms)),
            # (an MoE layer's output is in the residual stream's dtype already)
            Op("branch gradient cast", "autocast", 0, 1, 0, (FP32 + c) * h / sp, count=1 + (block.experts is None)),
        ]
    ops += _attention_ops(block, d, tp=tp, c=c, mixed=mixed)
    ops += _mlp_ops(block, d, tp=tp, c=c, mixed=mixed)
    return ops + _linear_ops(block, tp=tp, c=c)


def totals(ops: list[Op]) -> tuple[float, int, float, int]:
    """(forward bytes per token, forward kernels, backward bytes per token, backward kernels)."""
    fwd = sum(o.fwd_bytes * o.count for o in ops)
    bwd = sum(o.bwd_bytes * o.count for o in ops)
    return fwd, sum(o.fwd_kernels * o.count for o in ops), bwd, sum(o.bwd_kernels * o.count for o in ops)


def rebuilt_totals(ops: list[Op]) -> tuple[float, int]:
    """(forward bytes per token, forward kernels) an eager selective recompute runs again in backward."""
    return sum(o.fwd_bytes * o.rebuilt for o in ops), sum(o.fwd_kernels * o.rebuilt for o in ops)


def compiled_ops(block: Block, d: ModelDims, *, tp: int, sp: int, c: int) -> list[Op]:
    """The memory-bound work of a compiled block (``train.compile``): each chain of memory-bound
    ops between two matmuls (or attention) is one fused kernel that reads the chain's inputs once
    and writes its outputs once, forward and backward; per token, the residual stream in fp32 (r),
    matmul operands in the compute dtype (c), the norm regions on a sequence shard (``sp``)."""
    r, h, kv = FP32, d.hidden / sp, d.kv_heads * head_dim(d) / tp
    q = d.hidden / tp
    # the activation's width per token (an MoE layer's experts' times top_k and the shared
    # experts', over all tp ranks: not split over tp)
    f = (d.top_k + d.shared_experts) * d.moe_ffn if block.experts else d.ffn / tp
    mats = 2 if block.activation == Activation.SWIGLU else 1
    ops = [
        # norm 1 and its cast; backward reads x, the q/k/v linear's input gradient and the residual gradient
        Op("norm 1 region", "compiled", 1, 2, (r + c) * h, (3 * r + c) * h),
        Op("residual add, norm 2 and its cast", "compiled", 1, 2, (2 * r + 2 * c) * h, (3 * r + 2 * c) * h),
        Op("residual add", "compiled", 1, 2, (2 * r + c) * h, (r + c) * h),
        Op("activation", "compiled", 1, 1, mats * c * f + c * f, 2 * mats * c * f + c * f),
    ]
    if block.position == Position.ROPE or block.attention == "gqa":  # reads q, k, v; writes them rotated and repeated
        heads_out = 3 * q if block.attention == "gqa" else q + 2 * kv
        ops.append(Op("rope and repeat", "compiled", 1, 1, c * (q + 2 * kv) + c * heads_out, c * heads_out + c * (q + 2 * kv)))
    if d.bias:
        ops.append(Op("bias gradients", "compiled", 0, 3, 0, c * (2 * q + 2 * kv + mats * f + d.hidden)))
    # an MoE layer's routing and dispatch depend on the values (the experts' counts): they stay eager
    return ops + (_moe_ops(block, d, c=c, mixed=False) if block.experts else [])


def ends_ops(d: ModelDims, *, tp: int, c: int, mixed: bool, first: bool, last: bool) -> list[Op]:
    """The memory-bound work outside the blocks, always eager (``train.compile`` compiles the
    blocks): on the first stage the embedding, on the last the final norm (the output layer is a
    matmul, the loss ``llmforge.estimate.kernels.loss_cost``). ``tests/test_kernel_count.py``
    holds the blocks only: a CPU runs the embedding's backward and the loss with other kernels."""
    h, vocab = d.hidden, d.vocab / tp
    out = []
    if first:  # token and position lookups, their sum; backward scatters into the tables (zeroed first)
        out.append(Op("embedding", "models.gpt.GPT.forward", 3, 4, 28 * h, 12 * h, once=(0.0, FP32 * vocab * h)))
    if last:
        cast = (FP32 + c) * h if mixed else 0
        out.append(Op("final norm and its cast", "models.gpt.GPT.forward", 2, 3, 8 * h + cast, 20 * h + cast))
    return out
