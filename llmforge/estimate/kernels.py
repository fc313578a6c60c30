"""Time of one microbatch on one device, kernel by kernel (no torch).

One efficiency constant cannot describe every shape: a 768-wide model's matmuls
run far from peak, and its step is full of memory-bound and launch-bound work.
Each kernel llmforge's eager step runs is costed by what bounds it:

- a matmul ``[M x K] @ [K x N]``: ``2MKN / (peak x matmul_efficiency)`` stretched
  by ``1 + matmul_dim x (1/M + 1/K + 1/N)``: large GEMMs approach the profile's
  efficiency, narrow ones (small K or N) fall away from it;
- fused attention: the causal half of its FLOPs at ``attention_efficiency`` of
  peak (backward 2.5x forward);
- everything else (norms, activation functions, residual adds, autocast casts of
  activations, weights and gradients, RoPE, the loss over the logits, gradient
  accumulation, AdamW and the clip): bytes moved / (memory bandwidth x
  ``bandwidth_efficiency``);
- no kernel takes less than ``kernel_floor_us``: the host time per kernel of an eager
  training step (issuing it, autograd's bookkeeping, the module calls and view ops
  around it; ``llmforge calibrate`` times a step whose kernels have next to no work
  over ``microbatch_kernels``); on a CPU, where the same thread issues the op and runs
  it, every kernel takes that long more.

The byte counts follow llmforge's GPT as it runs (fp32 residual stream and norms,
16-bit matmul inputs under autocast, one cast of a norm output per consuming
linear, the chunked loss); with ``train.compile`` each block's memory-bound chains
are fused kernels (``llmforge.blockspec.costs.compiled_ops``). Every cost is a ``Cost``: seconds of matmuls,
attention, memory-bound work and what the launch floor adds, so the estimate can
report each term. The profile's rates are calibrated on measured runs
(docs/estimator.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from llmforge.blockspec import costs
from llmforge.blockspec.block import describe
from llmforge.config.choices import Activation, Recompute
from llmforge.estimate.params import Tensor, block_tensors, embedding_tensors
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout

FP32 = 4
LOSS_CHUNK_ELEMENTS = 2**26  # llmforge.train.loss.CHUNK_ELEMENTS
#: torch's ``loss_parallel`` on fp32 logits, the kernels over one rank's vocabulary shard: (aten
#: op, calls, bytes per logit each). Forward: the row maximum, the shift, exp, the sum of
#: exponentials, the log-softmax's subtraction; backward: the target's one-hot (zeroed, then
#: scattered per row), exp of the log-probabilities, the scaling by the gradient, a subtraction
#: and the sum of the two gradient paths. The target's gather and scatter touch one logit a row.
VOCAB_PARALLEL_LOSS_OPS = (
    ("amax", 1, 4),
    ("sub", 3, 8),
    ("exp", 2, 8),
    ("sum", 1, 4),
    ("zero_", 1, 4),
    ("mul", 1, 8),
    ("add", 1, 12),
    ("gather", 1, 0),
    ("_index_put_impl_", 1, 0),
)
#: ... and about 15 more kernels on per-row vectors (the targets' masks, the reduced maxima and sums).
VOCAB_PARALLEL_ROW_KERNELS = 15
OPTIMIZER_BYTES_PER_PARAM = 40  # fused AdamW reads p, g, m, v and writes p, m, v (28); the clip reads g twice, writes it (12)


class Cost(NamedTuple):
    """Seconds of some kernels, split by what bounds them: matmul and attention work at their
    rates, memory-bound work at the bandwidth, and the launch floor (what the kernels' floor adds
    where a kernel would otherwise finish sooner)."""

    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    floor: float = 0.0

    @property
    def seconds(self) -> float:
        return self.matmul + self.attention + self.memory + self.floor

    def plus(self, other: Cost) -> Cost:
        return Cost(self.matmul + other.matmul, self.attention + other.attention, self.memory + other.memory, self.floor + other.floor)

    def times(self, k: float) -> Cost:
        return Cost(self.matmul * k, self.attention * k, self.memory * k, self.floor * k)


NONE = Cost()


def total(costs: Iterable[Cost]) -> Cost:
    """The sum of ``costs``."""
    out = NONE
    for c in costs:
        out = out.plus(c)
    return out


@dataclass(frozen=True)
class Speeds:
    """The hardware rates one estimate uses (hashable: a cache key)."""

    peak: float
    matmul_efficiency: float
    matmul_dim: float
    attention_efficiency: float
    bandwidth: float
    floor: float
    attention_backward_efficiency: float = 0.0  # 0: as the forward
    #: The host issues and runs each op on one thread (a CPU): the floor adds to every kernel's
    #: work instead of bounding it from below, as a GPU's queue of launched kernels does.
    serial: bool = False

    def _floor(self, kernels: float, work: float) -> float:
        return kernels * self.floor if self.serial else max(0.0, kernels * self.floor - work)

    def gemm(self, m: float, k: float, n: float, count: int = 1, batch: int = 1) -> Cost:
        """``count`` kernels, each ``batch`` matmuls ``[m x k] @ [k x n]`` (a batched matmul)."""
        if m <= 0 or k <= 0 or n <= 0:
            return NONE
        work = batch * 2 * m * k * n / (self.peak * self.matmul_efficiency) * (1 + self.matmul_dim * (1 / m + 1 / k + 1 / n))
        return Cost(matmul=count * work, floor=count * self._floor(1, work))

    def memory(self, nbytes: float, kernels: int) -> Cost:
        """``kernels`` memory-bound kernels moving ``nbytes`` together."""
        if kernels <= 0:
            return NONE
        work = nbytes / self.bandwidth
        return Cost(memory=work, floor=self._floor(kernels, work))

    def attention(self, flops: float, kernels: int, *, head_dim: int, backward: bool = False) -> Cost:
        """Fused causal attention counted as ``flops`` (full-score convention):
        the causal half runs as matmuls whose inner dimension is the head's."""
        efficiency = self.attention_backward_efficiency if backward and self.attention_backward_efficiency else self.attention_efficiency
        work = 0.5 * flops / (self.peak * efficiency) * (1 + self.matmul_dim / head_dim)
        return Cost(attention=work, floor=self._floor(kernels, work))


def speeds(job: Job) -> Speeds:
    """The rates of ``job``'s profile and dtype (made once per Job: the search asks thousands of times)."""
    cached = job.__dict__.get("_speeds")
    if cached is None:
        p = job.profile
        cached = Speeds(
            peak=p.peak(job.param_dtype),
            matmul_efficiency=p.matmul_efficiency,
            matmul_dim=p.matmul_dim,
            attention_efficiency=p.attention_efficiency,
            bandwidth=p.memory_bandwidth * p.bandwidth_efficiency,
            floor=p.kernel_floor_us * 1e-6,
            attention_backward_efficiency=p.attention_backward_efficiency or p.attention_efficiency,
            serial=job.on_cpu,
        )
        object.__setattr__(job, "_speeds", cached)
    return cached


@dataclass(frozen=True)
class Kernels:
    """The work of one block (or the ends) for one microbatch."""

    gemms: tuple[tuple[float, float, float, int], ...]  # forward matmul kernels (m, k, n, matmuls in the batch)
    attention_flops: float  # forward, full-score convention
    fwd_bytes: float
    fwd_kernels: int
    bwd_bytes: float
    bwd_kernels: int
    weights: tuple[int, ...]  # local numel of each matmul weight/bias (cast per microbatch under autocast)
    head_dim: int = 64
    rebuilt_bytes: float = 0.0  # what eager selective recompute runs again (``costs.Op.rebuilt``)
    rebuilt_kernels: int = 0


@lru_cache(maxsize=4096)
def block_kernels(shape: Shape, *, t: float, tp: int, sp: int, ep: int, c: int, mixed: bool, moe: bool, fused: bool = False) -> Kernels:
    """One block's kernels for ``t`` local tokens (after context splitting): the matmuls of its
    description's linears and experts, and its memory-bound ops (``llmforge.blockspec.costs``),
    compiled (``fused``: ``train.compile``) or eager."""
    block = describe(shape, moe=moe)
    gemms: list[tuple[float, float, float, int]] = []
    for x in block.linears:  # in order, the experts' batched matmuls after the router
        gemms.append((t, x.in_features / (tp if x.split == "row" else 1), x.out_features / (tp if x.split == "col" else 1), 1))
        if x.name == "mlp.router":
            gemms += _expert_gemms(shape, t=t, ep=ep)
    if fused:
        ops = costs.compiled_ops(block, shape, tp=tp, sp=sp, c=c)
    else:
        ops = costs.eager_ops(block, shape, tp=tp, sp=sp, c=c, mixed=mixed)
    fwd, fwd_k, bwd, bwd_k = costs.totals(ops)
    rebuilt, rebuilt_k = costs.rebuilt_totals(ops)
    weights = tuple(_local_numel(x, tp=tp, ep=ep) for x in block_tensors(shape, moe) if _cast(x))
    flops = 4 * shape.attention_span * shape.hidden / tp * t
    return Kernels(tuple(gemms), flops, fwd * t, fwd_k, bwd * t, bwd_k, weights, shape.head_dim, rebuilt * t, rebuilt_k)


def _expert_gemms(shape: Shape, *, t: float, ep: int) -> list[tuple[float, float, float, int]]:
    """This rank's experts (``num_experts / ep``), balanced routing: one batched matmul over them
    each for up (and gate), and down."""
    rows = t * shape.top_k * min(1.0, shape.capacity_factor or 1.0)  # routed rows this rank's experts see (balanced)
    local = max(1, shape.num_experts // ep)
    per_expert = rows * ep / shape.num_experts
    mats = 2 if shape.activation == Activation.SWIGLU else 1
    gemm: list[tuple[float, float, float, int]] = [(per_expert, shape.hidden, shape.moe_ffn, local)]
    return gemm * mats + [(per_expert, shape.moe_ffn, shape.hidden, local)]


def _cast(t: Tensor) -> bool:
    """Autocast casts the weight and bias of every linear (norm weights stay fp32)."""
    return "norm" not in t.name


def _local_numel(t: Tensor, *, tp: int, ep: int) -> int:
    n = 1
    for d in t.local_shape(tp) if not t.expert else t.shape:
        n *= d
    return n // ep if t.expert else n


def _weights_cost(sp: Speeds, numels: Iterable[int], *, mixed: bool, accumulate: float, c: int) -> Cost:
    """Per microbatch: autocast's weight casts and gradient casts (mixed precision), and the
    gradient accumulation into the fp32 .grad (``accumulate``: share of microbatches that add)."""
    out = NONE
    for n in numels:
        if mixed:
            out = out.plus(sp.memory(n * (FP32 + c), 1)).plus(sp.memory(n * (c + FP32), 1))
        if accumulate:
            out = out.plus(sp.memory(12 * n, 1).times(accumulate))
    return out


def block_cost(sp: Speeds, k: Kernels, *, mode: str, mixed: bool, c: int, accumulate: float, rebuilds: bool = False) -> Cost:
    """Forward, backward and recomputation of one block for one microbatch; ``rebuilds``: selective
    recompute rebuilds the block's cheap steps (``llmforge.layout.selective_rebuilds``)."""
    fwd_gemm = total(sp.gemm(m, kk, n, batch=b) for m, kk, n, b in k.gemms)
    bwd_gemm = total(sp.gemm(m, n, kk, batch=b).plus(sp.gemm(kk, m, n, batch=b)) for m, kk, n, b in k.gemms)
    fwd_kernels, bwd_kernels = costs.ATTENTION_KERNELS
    attn_f = sp.attention(k.attention_flops, fwd_kernels, head_dim=k.head_dim)
    attn_b = sp.attention(2.5 * k.attention_flops, bwd_kernels, head_dim=k.head_dim, backward=True)
    fwd_mem, bwd_mem = sp.memory(k.fwd_bytes, k.fwd_kernels), sp.memory(k.bwd_bytes, k.bwd_kernels)
    weights = _weights_cost(sp, k.weights, mixed=mixed, accumulate=accumulate, c=c)
    out = total((fwd_gemm, bwd_gemm, attn_f, attn_b, fwd_mem, bwd_mem, weights))
    if mode == Recompute.FULL:  # the whole forward again, but its last matmul
        m, kk, n, b = k.gemms[-1]
        last = sp.gemm(m, kk, n, batch=b)
        out = total((out, fwd_gemm, last.times(-1), attn_f, fwd_mem))
    if mode == Recompute.SELECTIVE and rebuilds:  # norms, one residual add, RoPE, GQA repeat, heads' merge, activation
        return out.plus(sp.memory(k.rebuilt_bytes, k.rebuilt_kernels))
    if mode in (Recompute.FULL, Recompute.SELECTIVE) and mixed:  # the weights are cast again
        out = out.plus(total(sp.memory(n * (FP32 + c), 1) for n in k.weights))
    if mode == Recompute.SELECTIVE:  # op-level: the memory-bound forward (norms, casts, activations, RoPE; fused when compiled)
        out = out.plus(fwd_mem)
    return out


def ends_cost(sp: Speeds, shape: Shape, layout: Layout, *, c: int, mixed: bool, first: bool, last: bool, accumulate: float) -> Cost:
    """Embedding (first stage) and final norm, output layer and loss (last stage), one microbatch
    (never compiled: ``train.compile`` compiles the blocks)."""
    t = layout.micro_batch_size * shape.seq / layout.cp
    tp = layout.tp
    h, v = shape.hidden, shape.vocab / tp
    ops = costs.ends_ops(shape, tp=tp, c=c, mixed=mixed, first=first, last=last)
    out = total(
        sp.memory(t * o.fwd_bytes + o.once[0], o.fwd_kernels).plus(sp.memory(t * o.bwd_bytes + o.once[1], o.bwd_kernels)) for o in ops
    )
    if first:
        out = out.plus(_weights_cost(sp, [x.numel // tp for x in embedding_tensors(shape)], mixed=False, accumulate=accumulate, c=c))
    if last:
        out = total(
            (
                out,
                sp.gemm(t, h, v),
                sp.gemm(t, v, h),
                sp.gemm(h, t, v),
                loss_cost(sp, tokens=t, vocab=v, c=c, kind=loss_kind(tokens=t, vocab=v, c=c, tp=tp)),
            )
        )
        out = out.plus(_weights_cost(sp, [int(v * h)], mixed=mixed, accumulate=accumulate, c=c))
    return out


def loss_kind(*, tokens: float, vocab: float, c: int, tp: int) -> str:
    """Which cross-entropy ``llmforge.train.loss`` runs on this rank's logits."""
    if tp > 1:
        return "vocab_parallel"
    return "plain" if c == FP32 and tokens * vocab <= LOSS_CHUNK_ELEMENTS else "chunked"


def loss_cost(sp: Speeds, *, tokens: float, vocab: float, c: int, kind: str = "chunked") -> Cost:
    """The cross-entropy over ``[tokens x vocab]`` logits in dtype of ``c`` bytes, forward and backward.

    ``chunked`` (llmforge.train.loss): a log-softmax read in chunks and written in fp32
    per chunk; backward a softmax and a scaled write in the logits' dtype (7c + 12 bytes
    per logit). ``plain``: fp32 logits of one chunk go to ``F.cross_entropy``, whose
    log-softmax reads and writes each logit, the NLL's gradient is a zeroed tensor with one
    value a row, and the log-softmax's backward reads two and writes one (24 bytes per logit,
    five kernels). ``fp32_logits``: ``F.cross_entropy(logits.float())`` as a plain loop
    writes it: the fp32 copy, log-softmax, NLL, their backward and the cast back
    (8c + 36 bytes per logit). ``vocab_parallel``: torch's ``loss_parallel`` on this rank's
    vocabulary shard (``vocab``), which runs the log-softmax and its backward op by op
    (``VOCAB_PARALLEL_LOSS_OPS``)."""
    if kind == "fp32_logits":
        return sp.memory(tokens * vocab * (8 * c + 36), 8)
    if kind == "plain":
        return sp.memory(tokens * vocab * 6 * FP32, 5)
    if kind == "vocab_parallel":
        per_logit = sum(calls * nbytes for _, calls, nbytes in VOCAB_PARALLEL_LOSS_OPS)
        kernels = sum(calls for _, calls, _ in VOCAB_PARALLEL_LOSS_OPS) + VOCAB_PARALLEL_ROW_KERNELS
        if c != FP32:  # .float() forward, the gradient's cast back
            per_logit, kernels = per_logit + 2 * (c + FP32), kernels + 2
        return sp.memory(tokens * vocab * per_logit, kernels)
    chunks = max(1, -(-int(tokens) // max(1, LOSS_CHUNK_ELEMENTS // int(vocab))))
    return sp.memory(tokens * vocab * (7 * c + 12), 8 * chunks)


#: Rates under which every kernel's work takes no time, and each kernel a second: a Cost's
#: ``floor`` is then its count of kernels.
_COUNTER = Speeds(
    peak=float("inf"), matmul_efficiency=1.0, matmul_dim=0.0, attention_efficiency=1.0, bandwidth=float("inf"), floor=1.0, serial=True
)


def microbatch_kernels(shape: Shape, *, micro_batch_size: int) -> int:
    """Kernels of one eager fp32 microbatch on one device, forward and backward, its gradients
    added to earlier ones: what ``llmforge calibrate`` divides a training step's host time by
    (the profile's ``kernel_floor_us``)."""
    k = block_kernels(shape, t=micro_batch_size * shape.seq, tp=1, sp=1, ep=1, c=FP32, mixed=False, moe=False)
    blocks = block_cost(_COUNTER, k, mode=Recompute.NONE, mixed=False, c=FP32, accumulate=1.0).times(shape.num_layers)
    ends = ends_cost(_COUNTER, shape, Layout(micro_batch_size=micro_batch_size), c=FP32, mixed=False, first=True, last=True, accumulate=1.0)
    return round(blocks.plus(ends).floor)


def optimizer_cost(sp: Speeds, params: int, tensors: int) -> Cost:
    """The fused AdamW step and the gradient clip over this rank's parameters."""
    return sp.memory(OPTIMIZER_BYTES_PER_PARAM * params, max(4, tensors // 16))
