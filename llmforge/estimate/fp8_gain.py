"""What float8 changes in a block's step time, linear by linear (no torch).

A converted linear trades its three 16-bit matmuls (forward, input gradient, weight gradient)
for three float8 ones plus the casts and amax reductions around them
(``llmforge.estimate.fp8``). Both sides are priced by the kernel model
(``llmforge.estimate.kernels``), so a narrow model is not promised what a wide one gets:

- float8 matmuls reach ``FP8_EFFICIENCY_SHARE`` of the 16-bit efficiency at large shapes, and
  fall away from it ``FP8_DIM_FACTOR`` times faster as a dimension shrinks (their tiles are
  twice as deep for the same bytes, so a narrow K or N wastes twice the tensor-core work);
- the casts are memory-bound passes (fused under ``train.compile``) and each float8 linear
  launches ``EAGER_CAST_KERNELS`` kernels for them in eager mode, ``COMPILED_CAST_KERNELS``
  compiled: the launch floor a narrow layer pays.

The constants are set so that the model meets what was measured (docs/fp8.md): on one H100,
compiled, no gain at width 768, a few percent at 2048, more at 4096, torchtitan's +25% for
Llama-3 8B on 8 GPUs; torchao's microbenchmarks put a 1024 x 2048 x 1024 float8 linear at 0.8x.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmforge.blockspec.block import Linear, describe
from llmforge.blockspec.fp8 import Fp8Linear, block_fp8_linears
from llmforge.config.choices import Recompute
from llmforge.estimate import kernels as kn
from llmforge.estimate.fp8 import CAST_READS, FP8, FP32
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout

FP8_EFFICIENCY_SHARE = 0.95
FP8_DIM_FACTOR = 6.0
EAGER_CAST_KERNELS = 36
COMPILED_CAST_KERNELS = 8


@dataclass(frozen=True)
class LinearGain:
    """One block linear on one rank, one microbatch: its seconds in 16-bit and in float8."""

    linear: Fp8Linear
    bf16_s: float
    fp8_s: float

    @property
    def speedup(self) -> float:
        """How much faster float8 runs this linear (below 1: slower)."""
        return self.bf16_s / self.fp8_s if self.fp8_s > 0 else 1.0


def fp8_speeds(job: Job) -> kn.Speeds:
    """The kernel model's rates for float8 matmuls."""
    sp = kn.speeds(job)
    return replace(
        sp,
        peak=job.profile.peak("fp8"),
        matmul_efficiency=sp.matmul_efficiency * FP8_EFFICIENCY_SHARE,
        matmul_dim=sp.matmul_dim * FP8_DIM_FACTOR,
    )


def local_dims(linear: Fp8Linear, *, split: str, tp: int) -> tuple[float, float]:
    """(in, out) features of ``linear`` on one tensor-parallel rank (``split``: col / row / rep)."""
    return linear.in_features / (tp if split == "row" else 1), linear.out_features / (tp if split == "col" else 1)


def matmuls(sp: kn.Speeds, *, tokens: float, k: float, n: float, forwards: int = 1) -> kn.Cost:
    """A linear's matmuls for ``tokens``: ``forwards`` forward passes (2 when recomputed), the input
    gradient and the weight gradient."""
    return sp.gemm(tokens, k, n, count=forwards).plus(sp.gemm(tokens, n, k)).plus(sp.gemm(n, tokens, k))


def cast_cost(job: Job, *, tokens: float, k: float, n: float, shard: int = 1, recast: bool = False) -> kn.Cost:
    """The casts and amax reductions of one float8 linear (``llmforge.estimate.fp8`` counts the bytes):
    its input and output gradient per token, its fp32 weight per microbatch (``shard``: the ZeRO group
    the forward cast runs on with float8 all-gather); ``recast``: a recomputed forward casts its input again."""
    c, sp = job.compute_bytes, kn.speeds(job)
    per_element = c + 2 * FP8 if job.compile else 2 * (CAST_READS * c + FP8)
    weight_cast = (FP32 + 2 * FP8) / 2 if job.compile else CAST_READS * FP32 + FP8
    nbytes = tokens * (k + n) * per_element + (tokens * k * per_element / 2 if recast else 0.0)
    nbytes += k * n * weight_cast * (1 / shard + 1)
    return sp.memory(nbytes, COMPILED_CAST_KERNELS if job.compile else EAGER_CAST_KERNELS)


def fp8_cost(job: Job, *, tokens: float, k: float, n: float, forwards: int = 1, shard: int = 1) -> kn.Cost:
    """One float8 linear: its float8 matmuls and its casts."""
    return matmuls(fp8_speeds(job), tokens=tokens, k=k, n=n, forwards=forwards).plus(
        cast_cost(job, tokens=tokens, k=k, n=n, shard=shard, recast=forwards > 1)
    )


def linear_gains(shape: Shape, layout: Layout, job: Job, *, moe: bool = False) -> tuple[LinearGain, ...]:
    """Every linear of a block (dense, or MoE with ``moe``) with its float8 decision and its time
    both ways for one microbatch on one rank, without recompute, also where float8 does not run it."""
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    splits = {x.name: x.split for x in _block_linears(shape, moe=moe)}
    out = []
    for x in block_fp8_linears(shape, moe=moe, recipe=shape.fp8_recipe, linears=shape.fp8_linears):
        k, n = local_dims(x, split=splits[x.name], tp=layout.tp)
        bf16 = matmuls(kn.speeds(job), tokens=tokens, k=k, n=n).seconds
        out.append(LinearGain(x, bf16, fp8_cost(job, tokens=tokens, k=k, n=n).seconds))
    return tuple(out)


def block_delta(shape: Shape, layout: Layout, job: Job, *, moe: bool, recomputed: bool, shard: int) -> kn.Cost:
    """What float8 adds (negative: saves) to one block's microbatch: each converted linear's float8
    cost less its 16-bit matmuls (``recomputed``: under full recompute, every linear but the block's
    last runs its forward twice)."""
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    linears = _block_linears(shape, moe=moe)
    last = linears[-1].name
    out = kn.NONE
    for x in block_fp8_linears(shape, moe=moe, recipe=shape.fp8_recipe, linears=shape.fp8_linears):
        if not x.float8:
            continue
        k, n = local_dims(x, split=next(y.split for y in linears if y.name == x.name), tp=layout.tp)
        forwards = 2 if recomputed and layout.recompute == Recompute.FULL and x.name != last else 1
        bf16 = matmuls(kn.speeds(job), tokens=tokens, k=k, n=n, forwards=forwards)
        out = out.plus(fp8_cost(job, tokens=tokens, k=k, n=n, forwards=forwards, shard=shard)).plus(bf16.times(-1))
    return out


def _block_linears(shape: Shape, *, moe: bool) -> tuple[Linear, ...]:
    return describe(shape, moe=moe).linears
