"""Which linear layers of a transformer block run float8 matmuls (``precision.fp8``), from
their shapes alone.

One rule, read by the plan and the estimator (no torch) and by the backend
(``llmforge.parallel.float8`` converts exactly the names listed here):

- never the MoE router (its few outputs choose the experts) nor the routed experts (stacked
  weights run as batched matmuls); the embedding and the output layer are not block linears;
- never a linear with a dimension that is not a multiple of 16 (FP8 tensor cores need it);
- with ``precision.fp8_linears=auto``, only shapes large enough for float8 to pay: torchao's
  size rule for the recipe (``torchao.float8._auto_filter_for_recipe``, from its H100
  microbenchmarks of a float8 linear with its casts and amax reductions against a bf16 one).
  Tensorwise leaves out ``in_features <= 4096 and out_features <= 1024``; rowwise, whose casts
  cost more, leaves out ``out_features <= 2048``, ``in_features <= 1024`` and
  ``out_features <= 4096 and in_features <= 2048``.
  At width 768 (gpt-125m) that keeps the fused q/k/v and the MLP's up projection; from width
  2048 on, every block linear.

Shapes are the whole layer's (``nn.Linear(in_features, out_features)``), as float8 is applied
before tensor parallelism splits them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.blockspec.block import Linear, describe
from llmforge.blockspec.dims import ModelDims, dims_of
from llmforge.config.choices import Fp8Linears, Fp8Recipe
from llmforge.config.schema import RunConfig

#: Block linears that stay in high precision, by name part.
KEPT_HIGH_PRECISION = ("router",)
#: FP8 tensor cores need both matmul dimensions a multiple of this.
ALIGNMENT = 16


@dataclass(frozen=True)
class Fp8Linear:
    """One linear layer of a block and whether float8 runs it (``why``: the reason, in words)."""

    name: str
    in_features: int
    out_features: int
    float8: bool
    why: str


def too_small(*, recipe: str, in_features: int, out_features: int) -> str | None:
    """Which of torchao's size limits ``recipe`` puts on a float8 linear this shape misses (None: it pays)."""
    k, n = in_features, out_features
    if recipe == Fp8Recipe.TENSORWISE:
        return "in_features <= 4096 and out_features <= 1024" if k <= 4096 and n <= 1024 else None
    if n <= 2048:
        return "out_features <= 2048"
    if k <= 1024:
        return "in_features <= 1024"
    if n <= 4096 and k <= 2048:
        return "out_features <= 4096 and in_features <= 2048"
    return None


def decide(linear: Linear, *, recipe: str, linears: str) -> Fp8Linear:
    """Whether float8 runs ``linear`` (``recipe``: precision.fp8_recipe; ``linears``: precision.fp8_linears)."""
    k, n = linear.in_features, linear.out_features

    def verdict(float8: bool, why: str) -> Fp8Linear:
        return Fp8Linear(linear.name, k, n, float8, why)

    if any(part in KEPT_HIGH_PRECISION for part in linear.name.split(".")):
        return verdict(False, "the router stays in high precision")
    if k % ALIGNMENT or n % ALIGNMENT:
        return verdict(False, f"a dimension is not a multiple of {ALIGNMENT}")
    small = too_small(recipe=recipe, in_features=k, out_features=n) if linears == Fp8Linears.AUTO else None
    if small is not None:
        return verdict(False, f"too small for {recipe} float8 to pay ({small})")
    return verdict(True, "float8")


def block_fp8_linears(dims: ModelDims, *, moe: bool, recipe: str, linears: str) -> tuple[Fp8Linear, ...]:
    """Every linear layer of a block (dense, or MoE with ``moe``) with its float8 decision."""
    return tuple(decide(x, recipe=recipe, linears=linears) for x in describe(dims, moe=moe).linears)


@dataclass(frozen=True)
class Fp8Choice:
    """The names (relative to a block, e.g. ``attn.qkv_proj``) of the linears float8 runs, per block kind."""

    dense: frozenset[str]
    moe: frozenset[str]

    def names(self, *, moe: bool) -> frozenset[str]:
        return self.moe if moe else self.dense


def fp8_choice(dims: ModelDims, *, recipe: str, linears: str) -> Fp8Choice:
    """The float8 linears of ``dims``'s dense and MoE blocks."""

    def chosen(moe: bool) -> frozenset[str]:
        if moe and not dims.num_experts:
            return frozenset()
        return frozenset(x.name for x in block_fp8_linears(dims, moe=moe, recipe=recipe, linears=linears) if x.float8)

    return Fp8Choice(dense=chosen(False), moe=chosen(True))


def fp8_choice_of(config: RunConfig) -> Fp8Choice:
    """The float8 linears a run's config asks for (``precision.fp8_recipe``, ``precision.fp8_linears``)."""
    return fp8_choice(dims_of(config.model), recipe=config.precision.fp8_recipe, linears=config.precision.fp8_linears)
