"""Device memory of each pipeline stage, and the most-loaded device.

Model states follow llmforge's precision: parameters are always fp32 (bf16/fp16
compute through autocast, so the parameters are the master weights), gradients
are fp32 (the parameters' dtype), and AdamW keeps two fp32 moments: 16 bytes per
parameter before ZeRO. ZeRO splits over the parameter's data-parallel group
(dp x cp for dense weights, dp x cp / ep for experts):

- ZeRO-1 shards the optimizer states, ZeRO-2 also the gradients, evenly over the
  flat parameter list (the most-loaded rank holds the rounded-up share);
- ZeRO-3 (FSDP2 ``fully_shard``) shards each parameter along dim 0, padded to a
  multiple of the group size, and all-gathers a block at a time for compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

from llmforge.estimate import activations as act
from llmforge.estimate.params import RankParams, block_tensors, layout_rank_params, stage_layers
from llmforge.estimate.pipeline import inflight_microbatches
from llmforge.estimate.shape import DTYPE_BYTES, Job, Layout, Shape

FP32 = 4
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
FRAGMENTATION = 0.10  # of activations and transient buffers: caching-allocator slack
DDP_BUCKET_BYTES = 2 * 25 * 1024**2  # two 25 MiB gradient buckets in flight


@dataclass(frozen=True)
class StageMemory:
    """Bytes on the most-loaded rank of one pipeline stage."""

    stage: int
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    reserved: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient + self.reserved


def _sharded(params: RankParams, *, group: int, expert_group: int, zero3: bool) -> float:
    """Elements this rank keeps of its parameters once split over the data-parallel group."""
    if not zero3:
        return _even(params.dense_numel, group) + _even(params.expert_numel, expert_group)
    dense = sum(_dim0_shard(s, group) for s in params.dense)
    return dense + sum(_dim0_shard(s, expert_group) for s in params.expert)


def _even(n: int, group: int) -> int:
    return math.ceil(n / group) if n else 0


def _dim0_shard(shape: Tuple[int, ...], group: int) -> int:
    rest = 1
    for d in shape[1:]:
        rest *= d
    return math.ceil(shape[0] / group) * rest


def groups(layout: Layout) -> Tuple[int, int]:
    """(data-parallel group of dense weights, of expert weights)."""
    group = layout.dp * layout.cp
    return group, max(1, group // layout.ep)


def model_states(shape: Shape, layout: Layout, stage: int) -> Tuple[int, float, float, float]:
    """(parameters on this rank, weight bytes, gradient bytes, optimizer bytes) under ZeRO."""
    params = layout_rank_params(shape, layout, stage)
    group, expert_group = groups(layout)
    full = params.numel
    shard = _sharded(params, group=group, expert_group=expert_group, zero3=layout.zero == 3)
    weights = FP32 * (shard if layout.zero == 3 else full)
    grads = FP32 * (shard if layout.zero >= 2 else full)
    optimizer = ADAM_STATE_BYTES * (shard if layout.zero >= 1 else full)
    return full, weights, grads, optimizer


def stage_activations(shape: Shape, layout: Layout, job: Job, stage: int, microbatches: int) -> float:
    """Saved activations on this stage's rank at the schedule's peak."""
    layers = stage_layers(shape, layout.pp, layout.virtual_stages, layout.pp_layers)[stage]
    per_mb = sum(act.layer_bytes(shape, layout, job, i) for i in layers)
    if stage == 0:
        per_mb += act.embedding_bytes(shape, layout)
    if (shape.num_layers - 1) in layers:
        per_mb += act.output_bytes(shape, layout, job)
    return per_mb * inflight_microbatches(layout, stage=stage, microbatches=microbatches)


def _transient(shape: Shape, layout: Layout, job: Job, stage: int) -> float:
    """Short-lived buffers: logits at the loss, recompute working set, FSDP gathers, DDP buckets."""
    layers = stage_layers(shape, layout.pp, layout.virtual_stages, layout.pp_layers)[stage]
    out = act.recompute_working_bytes(shape, layout, job)
    if (shape.num_layers - 1) in layers:
        out += act.logits_peak_bytes(shape, layout, job)
    if layout.zero == 3 and layers:
        block = sum(t.numel for t in block_tensors(shape, shape.is_moe_layer(layers[0]))) / layout.tp
        # two blocks gathered at once (current + prefetched) in compute dtype, one block's fp32 grads
        out += block * (2 * job.compute_bytes + FP32)
    elif layout.dp * layout.cp > 1:
        out += DDP_BUCKET_BYTES
    return out


def stage_memory(shape: Shape, layout: Layout, job: Job, stage: int, microbatches: int) -> StageMemory:
    """Full breakdown for pipeline ``stage`` (tp rank 0, ep rank 0, dp rank 0: the fullest shards)."""
    params, weights, grads, optimizer = model_states(shape, layout, stage)
    activations = stage_activations(shape, layout, job, stage, microbatches)
    transient = _transient(shape, layout, job, stage)
    if layout.zero in (1, 2) and job.reduce_dtype != "fp32":
        transient += params * DTYPE_BYTES[job.reduce_dtype] / max(1, layout.dp * layout.cp)
    reserved = job.profile.runtime_reserved_bytes + FRAGMENTATION * (activations + transient)
    return StageMemory(stage, params, weights, grads, optimizer, activations, transient, reserved)


def all_stages(shape: Shape, layout: Layout, job: Job, microbatches: int) -> List[StageMemory]:
    return [stage_memory(shape, layout, job, s, microbatches) for s in range(layout.pp)]


def most_loaded(stages: List[StageMemory]) -> StageMemory:
    return max(stages, key=lambda m: m.total)
