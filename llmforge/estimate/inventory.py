"""What each pipeline rank of a layout holds: built once per (shape, layout), read by every part.

``inventory(shape, layout)`` asks llmforge.estimate.params once for each pipeline rank's
blocks by kind (``StageCounts``), its parameters on tensor-parallel rank 0 and expert rank
0 (``RankParams``) and their FSDP2 shard, and for each block kind (dense, MoE) its tensors,
their elements on one rank and the elements FP8 converts. Memory, compute, communication,
offload and the node's host memory are functions of (inventory, job) and read these
figures instead of deriving them again.

An inventory depends on the layout's structure only (``structure_key``); the search keeps
one memo of them (``Inventories``), so the layouts that differ in micro batch, schedule or
sequence parallelism share one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache

from llmforge.blockspec.fp8 import fp8_choice
from llmforge.config.choices import Recompute
from llmforge.estimate.node import largest_parameter
from llmforge.estimate.params import RankParams, StageCounts, Tensor, block_tensors, layout_rank_params, representative_stages, stage_counts
from llmforge.estimate.shape import Shape
from llmforge.layout import Layout, expert_shard_dim

StructureKey = tuple[object, ...]


@dataclass(frozen=True)
class BlockKind:
    """One kind of block (dense or MoE) on tensor-parallel rank 0, expert rank 0."""

    moe: bool
    tensors: tuple[Tensor, ...]
    #: Elements on one rank: each tensor's tensor-parallel shard, of the stacked experts E / ep.
    numel: float
    #: The linear weights FP8 converts (``fp8_converts``), and their elements on one tensor-parallel rank.
    converted: tuple[Tensor, ...]
    converted_numel: float


@dataclass(frozen=True)
class Stage:
    """One pipeline rank: its blocks by kind, its parameters, and their FSDP2 shard."""

    index: int
    counts: StageCounts
    params: RankParams
    #: Elements this rank keeps of its parameters under FSDP2 (each split over its data-parallel
    #: group, padded: dense ones on dim 0, experts on ``expert_shard_dim``; the whole stage on a group of one).
    shard: int


@dataclass(frozen=True)
class Inventory:
    """Per pipeline rank (``stages``) and per block kind, what a layout's ranks hold."""

    shape: Shape
    layout: Layout
    stages: tuple[Stage, ...]
    #: One pipeline rank per distinct stage content, the earliest (params.representative_stages).
    representatives: tuple[int, ...]
    dense: BlockKind
    moe: BlockKind | None
    #: Elements of the model's largest single parameter (llmforge.estimate.node).
    largest_parameter: int
    #: Figures derived for the one job this inventory is estimated with, which other layouts ask
    #: for again (a stage's kernel time: llmforge.estimate.core); the search's inventories share one.
    memo: dict[tuple[object, ...], object] = field(default_factory=dict, compare=False, repr=False)

    def counts(self, stage: int) -> StageCounts:
        return self.stages[stage].counts

    def block(self, moe: bool) -> BlockKind:
        kind = self.moe if moe else self.dense
        assert kind is not None, "an MoE block of a model without experts"
        return kind

    def largest_block(self, stage: int) -> float:
        """Elements of this stage's largest block on one tensor-parallel rank."""
        c = self.counts(stage)
        dense = self.dense.numel if c.dense + c.dense_ckpt else 0.0
        moe = self.moe.numel if self.moe is not None and c.moe + c.moe_ckpt else 0.0
        return max(dense, moe)

    def for_layout(self, layout: Layout) -> Inventory:
        """This inventory for ``layout``, a layout of the same structure (``structure_key``)."""
        return self if layout is self.layout else dataclasses.replace(self, layout=layout)


def structure_key(layout: Layout) -> StructureKey:
    """The layout fields an inventory depends on."""
    every = layout.recompute_every if layout.recompute == Recompute.FULL else 1
    return (layout.pp, layout.pp_virtual_stages, layout.pp_layers, layout.v_shape, every, layout.tp, layout.ep, layout.dp_shard, layout.cp)


def inventory(shape: Shape, layout: Layout, *, memo: dict[tuple[object, ...], object] | None = None) -> Inventory:
    """The inventory of ``layout`` for ``shape`` (``memo``: shared with other inventories of one job)."""
    group, expert_group = zero_groups(layout)
    stages = []
    for index, counts in enumerate(stage_counts(shape, layout)):
        params = layout_rank_params(shape, layout, index)
        stages.append(Stage(index, counts, params, _fsdp_shards(params, group=group, expert_group=expert_group)))
    return Inventory(
        shape=shape,
        layout=layout,
        stages=tuple(stages),
        representatives=representative_stages(shape, layout),
        dense=_block_kind(shape, layout, moe=False),
        moe=_block_kind(shape, layout, moe=True) if shape.num_experts else None,
        largest_parameter=largest_parameter(shape),
        memo={} if memo is None else memo,
    )


def zero_groups(layout: Layout) -> tuple[int, int]:
    """(data-parallel group of dense weights, of expert weights); ZeRO shards over them
    (over a shard group of dp / dp_replicate ranks under HSDP)."""
    group = layout.dp_shard * layout.cp
    return group, max(1, group // layout.ep)


def fp8_converts(t: Tensor, shape: Shape, *, moe: bool) -> bool:
    """Whether parameter ``t`` of a (dense or ``moe``) block is the weight of a linear layer FP8
    runs: one of those ``llmforge.blockspec.fp8`` chooses by shape, as the backend converts them."""
    return t.name.endswith(".weight") and t.name.removesuffix(".weight") in fp8_names(shape, moe=moe)


@lru_cache(maxsize=256)
def fp8_names(shape: Shape, *, moe: bool) -> frozenset[str]:
    """The names of the linears float8 runs in a block of ``shape`` (its recipe and choice)."""
    return fp8_choice(shape, recipe=shape.fp8_recipe, linears=shape.fp8_linears).names(moe=moe)


def _block_kind(shape: Shape, layout: Layout, *, moe: bool) -> BlockKind:
    tensors = block_tensors(shape, moe)
    numel = 0.0
    for t in tensors:
        local = math.prod(t.local_shape(layout.tp))
        numel += local / layout.ep if t.expert else local
    converted = tuple(t for t in tensors if fp8_converts(t, shape, moe=moe))
    converted_numel: float = sum(t.numel / (layout.tp if t.split != "rep" else 1) for t in converted)
    return BlockKind(moe=moe, tensors=tensors, numel=numel, converted=converted, converted_numel=converted_numel)


def _fsdp_shards(params: RankParams, *, group: int, expert_group: int) -> int:
    dense = sum(fsdp_shard(s, group=group, dim=0) for s in params.dense)
    return dense + sum(fsdp_shard(s, group=expert_group, dim=expert_shard_dim(s, group=expert_group)) for s in params.expert)


def fsdp_shard(shape: tuple[int, ...], *, group: int, dim: int) -> int:
    """Elements FSDP2 allocates on each of ``group`` ranks for a parameter of local ``shape``
    sharded on ``dim``: torch.chunk's first (largest) piece, to which every rank pads."""
    return math.ceil(shape[dim] / group) * math.prod(shape) // max(1, shape[dim])


class Inventories:
    """The search's one memo: an inventory per layout structure of one shape, for one job."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self._by_structure: dict[StructureKey, Inventory] = {}
        self._memo: dict[tuple[object, ...], object] = {}

    def of(self, layout: Layout) -> Inventory:
        key = structure_key(layout)
        found = self._by_structure.get(key)
        if found is None:
            found = self._by_structure[key] = inventory(self.shape, layout, memo=self._memo)
        return found.for_layout(layout)
