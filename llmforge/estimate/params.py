"""Parameter inventory of llmforge's GPT, and how it splits over ranks.

Every parameter tensor of the model is listed with its shape and how tensor
parallelism cuts it (``col``: output rows split, ``row``: input columns split,
``vocab``: vocabulary rows split, ``rep``: replicated). Counts per rank follow
from the shapes, so the per-rank figures are exact, not ratios.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from llmforge.blockspec.block import Param, describe, model_tensors
from llmforge.config.choices import Recompute
from llmforge.estimate.shape import Shape
from llmforge.layout import Layout, chunk_rank

#: One parameter tensor (``llmforge.blockspec.block.Param``): shape, TP split, expert or not.
Tensor = Param


@lru_cache(maxsize=64)
def block_tensors(shape: Shape, moe: bool) -> tuple[Tensor, ...]:
    """Parameters of one transformer block (dense or MoE), as its description lists them."""
    return describe(shape, moe=moe).params


def moe_tensors(shape: Shape) -> list[Tensor]:
    """The MoE layer's parameters: router, stacked experts ``[E, ...]`` (split over ep on
    dim 0), shared MLP; tensor parallelism leaves them whole."""
    return [t for t in block_tensors(shape, True) if t.name.startswith("mlp.")]


def embedding_tensors(shape: Shape) -> list[Tensor]:
    """Token embedding (vocab-parallel) and learned positions (replicated)."""
    return model_tensors(shape)[0]


def head_tensors(shape: Shape, *, separate_copy: bool) -> list[Tensor]:
    """Final norm and output projection; a tied head owns no weight unless on another stage."""
    return model_tensors(shape, separate_head=separate_copy)[1]


@lru_cache(maxsize=256)
def stage_layers(shape: Shape, pp: int, v: int, pp_layers: tuple[int, ...] | None, v_shape: bool = False) -> tuple[tuple[int, ...], ...]:
    """Block indices held by each pipeline rank (its chunks: ``llmforge.layout.chunk_rank``)."""
    chunks = list(pp_layers) if pp_layers else [shape.num_layers // (pp * v)] * (pp * v)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for c, (start, n) in enumerate(zip(starts, chunks, strict=False)):
        ranks[chunk_rank(c, pp=pp, v_shape=v_shape)].extend(range(start, start + n))
    return tuple(tuple(sorted(r)) for r in ranks)


@lru_cache(maxsize=4096)
def stage_tensors(shape: Shape, layout_key: tuple[int, int, tuple[int, ...] | None, int, bool]) -> tuple[Tensor, ...]:
    """Every parameter tensor held by pipeline rank ``stage`` (before TP/EP/ZeRO splits)."""
    pp, v, pp_layers, stage, v_shape = layout_key
    layers = stage_layers(shape, pp, v, pp_layers, v_shape)[stage]
    out: list[Tensor] = embedding_tensors(shape) if stage == 0 else []
    for i in layers:
        out += block_tensors(shape, shape.is_moe_layer(i))
    last = (shape.num_layers - 1) in layers
    if last:
        out += head_tensors(shape, separate_copy=pp > 1)  # a tied head is a copy on its own chunk
    return tuple(out)


@lru_cache(maxsize=256)
def total_params(shape: Shape) -> int:
    """Parameters of the whole model (tied embedding counted once)."""
    n = sum(t.numel for t in embedding_tensors(shape)) + sum(t.numel for t in head_tensors(shape, separate_copy=False))
    return n + sum(sum(t.numel for t in block_tensors(shape, shape.is_moe_layer(i))) for i in range(shape.num_layers))


@lru_cache(maxsize=256)
def active_params(shape: Shape) -> int:
    """Parameters a token passes through: routed experts count top_k of num_experts."""
    if shape.num_experts == 0:
        return total_params(shape)
    one_expert = sum(t.numel for t in moe_tensors(shape) if t.expert) // shape.num_experts
    idle = (shape.num_experts - shape.top_k) * one_expert * shape.num_moe_layers
    return total_params(shape) - idle


@dataclass(frozen=True)
class RankParams:
    """Parameters on one rank, before ZeRO: dense (DP over dp*cp) and expert (DP over dp*cp/ep)."""

    dense: tuple[tuple[int, ...], ...]
    expert: tuple[tuple[int, ...], ...]

    @cached_property
    def dense_numel(self) -> int:
        return sum(_prod(s) for s in self.dense)

    @cached_property
    def expert_numel(self) -> int:
        return sum(_prod(s) for s in self.expert)

    @cached_property
    def numel(self) -> int:
        return self.dense_numel + self.expert_numel


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@lru_cache(maxsize=4096)
def rank_params(
    shape: Shape, *, pp: int, v: int, pp_layers: tuple[int, ...] | None, stage: int, tp: int, ep: int, v_shape: bool = False
) -> RankParams:
    """Local parameter shapes on (pipeline ``stage``, tp rank 0, ep rank 0)."""
    dense: list[tuple[int, ...]] = []
    expert: list[tuple[int, ...]] = []
    for t in stage_tensors(shape, (pp, v, pp_layers, stage, v_shape)):
        if t.expert:
            expert.append((t.shape[0] // ep,) + t.shape[1:])
        else:
            dense.append(t.local_shape(tp))
    return RankParams(tuple(dense), tuple(expert))


def layout_rank_params(shape: Shape, layout: Layout, stage: int) -> RankParams:
    """``rank_params`` for a Layout."""
    return rank_params(
        shape,
        pp=layout.pp,
        v=layout.pp_virtual_stages,
        pp_layers=layout.pp_layers,
        stage=stage,
        tp=layout.tp,
        ep=layout.ep,
        v_shape=layout.v_shape,
    )


def named_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of the whole one-process model, named as ``GPT`` names them."""
    out = {t.name: t.shape for t in embedding_tensors(shape)}
    for i in range(shape.num_layers):
        out.update({f"layers.{i}.{t.name}": t.shape for t in block_tensors(shape, shape.is_moe_layer(i))})
    out.update({t.name: t.shape for t in head_tensors(shape, separate_copy=False)})
    return out


@dataclass(frozen=True)
class StageCounts:
    """What one pipeline rank holds, by kind: blocks (dense/MoE x checkpointed or not), ends."""

    dense: int
    moe: int
    dense_ckpt: int
    moe_ckpt: int
    first: bool
    last: bool

    @property
    def blocks(self) -> int:
        return self.dense + self.moe + self.dense_ckpt + self.moe_ckpt


@lru_cache(maxsize=8192)
def _stage_counts(shape: Shape, pp: int, v: int, pp_layers: tuple[int, ...] | None, v_shape: bool, every: int) -> tuple[StageCounts, ...]:
    out = []
    for stage, layers in enumerate(stage_layers(shape, pp, v, pp_layers, v_shape)):
        kinds = [(shape.is_moe_layer(i), i % every == 0) for i in layers]
        out.append(
            StageCounts(
                dense=kinds.count((False, False)),
                moe=kinds.count((True, False)),
                dense_ckpt=kinds.count((False, True)),
                moe_ckpt=kinds.count((True, True)),
                first=stage == 0,
                last=(shape.num_layers - 1) in layers,
            )
        )
    return tuple(out)


def stage_counts(shape: Shape, layout: Layout) -> tuple[StageCounts, ...]:
    """Per pipeline rank: blocks by kind (checkpointed = recomputed in full under ``recompute_every``)."""
    memo = layout.__dict__.get("_counts")  # asked ~10 times per estimate: kept on the layout
    if memo is not None and memo[0] is shape:
        counted: tuple[StageCounts, ...] = memo[1]
        return counted
    every = layout.recompute_every if layout.recompute == Recompute.FULL else 1
    counts = _stage_counts(shape, layout.pp, layout.pp_virtual_stages, layout.pp_layers, layout.v_shape, every)
    object.__setattr__(layout, "_counts", (shape, counts))
    return counts


@lru_cache(maxsize=8192)
def _representatives(counts: tuple[StageCounts, ...]) -> tuple[int, ...]:
    first: dict[StageCounts, int] = {}
    for stage, c in enumerate(counts):
        first.setdefault(c, stage)
    return tuple(sorted(first.values()))


def representative_stages(shape: Shape, layout: Layout) -> tuple[int, ...]:
    """One pipeline rank per distinct stage content, the earliest: every schedule holds
    at least as many microbatches on an earlier rank, so the others cannot be the
    most loaded or the slowest."""
    return _representatives(stage_counts(shape, layout))
