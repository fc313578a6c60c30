"""Device memory of each pipeline stage, and the most-loaded device.

Model states follow llmforge's precision: parameters are always fp32 master
weights and AdamW keeps two fp32 moments. ZeRO 0 computes from them through
autocast with fp32 gradients: 16 bytes per parameter. ZeRO 1-3 run on FSDP2 (see
``model_states``), which shards each parameter along dim 0, padded to a multiple
of the group size, over the parameter's data-parallel group (dp x cp for dense
weights, dp x cp / ep for experts; the most-loaded rank holds the rounded-up
shards), and computes from gathered copies in ``precision.param_dtype``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from llmforge.config.dtypes import DTYPE_BYTES
from llmforge.estimate import activations as act
from llmforge.estimate import fp8, muon
from llmforge.estimate.allocator import slack_fraction
from llmforge.estimate.cpu_memory import cpu_step_bytes
from llmforge.estimate.offload import device_memory
from llmforge.estimate.params import RankParams, block_tensors, layout_rank_params, representative_stages, stage_counts
from llmforge.estimate.pipeline import inflight_microbatches
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout

FP32 = 4
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
#: A CPU rank's process before its model: the interpreter, torch, llmforge, gloo and the
#: data loader, resident (rank 0 of a tiny dp8 run peaks at 0.37 GiB, 15 MiB of it tensors).
CPU_PROCESS_BYTES = int(0.35 * 2**30)


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


_SHARDS: dict = {}


def _cached_shard(params: RankParams, group: int, expert_group: int) -> int:
    """``_sharded`` memoised by object identity (RankParams come from an lru_cache)."""
    key = (id(params), group, expert_group)
    hit = _SHARDS.get(key)
    if hit is None or hit[0] is not params:
        hit = _SHARDS[key] = (params, _sharded(params, group=group, expert_group=expert_group, zero3=True))
    return hit[1]


def _even(n: int, group: int) -> int:
    return math.ceil(n / group) if n else 0


def _dim0_shard(shape: tuple[int, ...], group: int) -> int:
    rest = 1
    for d in shape[1:]:
        rest *= d
    return math.ceil(shape[0] / group) * rest


def groups(layout: Layout) -> tuple[int, int]:
    """(data-parallel group of dense weights, of expert weights); ZeRO shards over them
    (over a shard group of dp / dp_replicate ranks under HSDP)."""
    group = layout.dp_shard * layout.cp
    return group, max(1, group // layout.ep)


def model_states(shape: Shape, layout: Layout, stage: int, job: Job) -> tuple[int, float, float, float]:
    """See ``_compute_model_states``; memoised on the fields it depends on (the search varies the others)."""
    key = (
        layout.dp,
        layout.tp,
        layout.pp,
        layout.cp,
        layout.ep,
        layout.zero,
        layout.virtual_stages,
        layout.pp_layers,
        layout.v_shape,
        layout.dp_replicate,
        job.param_dtype,
        job.reduce_dtype,
        job.fp8_all_gather,
        stage,
    )
    return _model_states(shape, key, layout, job)


_STATES: dict = {}


def _model_states(shape: Shape, key: tuple, layout: Layout, job: Job) -> tuple[int, float, float, float]:
    hit = _STATES.get(key)
    if hit is not None and hit[0] is shape:
        return hit[1]
    value = _compute_model_states(shape, layout, key[-1], job)
    if len(_STATES) > 65536:
        _STATES.clear()
    _STATES[key] = (shape, value)
    return value


def _compute_model_states(shape: Shape, layout: Layout, stage: int, job: Job) -> tuple[int, float, float, float]:
    """(parameters on this rank, weight bytes, gradient bytes, optimizer bytes) at the step's peak.

    ZeRO 1-3 are FSDP2 ``fully_shard`` (llmforge.parallel.data): the fp32 master
    weights and the AdamW moments are sharded; the compute copy (in
    ``precision.param_dtype``) stays whole through the step under ZeRO 1 and 2 (and
    any stage under a pipeline, whose schedule keeps it until the last
    microbatch) and exists one block at a time under ZeRO 3 (a transient buffer);
    ZeRO 1 (and any stage under a pipeline) accumulates whole gradients in
    ``precision.reduce_dtype``, ZeRO 2 and 3 keep only an fp32 gradient shard.
    """
    params = layout_rank_params(shape, layout, stage)
    group, expert_group = groups(layout)
    full = params.numel
    if layout.zero == 0 or layout.dp * layout.cp == 1:
        return full, FP32 * full, FP32 * full, ADAM_STATE_BYTES * full
    shard = _cached_shard(params, group, expert_group)
    whole_copy = layout.zero < 3 or layout.pp > 1
    weights = FP32 * shard + (job.compute_bytes * full - _float8_saving(shape, layout, job, stage) if whole_copy else 0)
    whole_grads = layout.zero == 1 or layout.pp > 1
    grads = DTYPE_BYTES[job.reduce_dtype] * (full + _embedding_grad_excess(shape, layout, stage)) if whole_grads else FP32 * shard
    return full, weights, grads, ADAM_STATE_BYTES * shard


def _embedding_grad_excess(shape: Shape, layout: Layout, stage: int) -> float:
    """Elements the accumulated gradient of a vocab-parallel embedding holds beyond its shard.

    DTensor has no row-sharded strategy for the embedding's backward: on each tp rank the
    weight's gradient comes out as a Partial of the whole table (vocab x hidden), and FSDP2
    accumulates it so across microbatches (in ``reduce_dtype``) until the last one reduces it
    to the rank's rows. The rehearsal of llama-405b's first stage holds it (7.8 GiB in fp32).
    A tied table that the same stage's output layer also uses gets its rows' gradient from
    that matmul too, and the sum keeps the rows (llmforge.train.footprint measures it so)."""
    counts = stage_counts(shape, layout)[stage]
    if layout.tp == 1 or not counts.first or (shape.tie_embeddings and counts.last):
        return 0.0
    return shape.vocab * shape.hidden * (layout.tp - 1) / layout.tp


def _float8_saving(shape: Shape, layout: Layout, job: Job, stage: int) -> float:
    """Bytes a whole compute copy saves when FSDP gathers the converted weights as float8."""
    if not job.fp8_all_gather:
        return 0.0
    counts = stage_counts(shape, layout)[stage]
    low = (counts.dense + counts.dense_ckpt) * fp8.converted_numel(shape, moe=False, tp=layout.tp)
    low += (counts.moe + counts.moe_ckpt) * fp8.converted_numel(shape, moe=True, tp=layout.tp)
    return low * (job.compute_bytes - fp8.FP8)


def stage_activations(shape: Shape, layout: Layout, job: Job, stage: int, microbatches: int) -> float:
    """Saved activations on this stage's rank at the schedule's peak."""
    per_mb = act.stage_bytes_per_microbatch(shape, layout, job, stage_counts(shape, layout)[stage])
    return per_mb * inflight_microbatches(layout, stage=stage, microbatches=microbatches)


@lru_cache(maxsize=256)
def _block_numel(shape: Shape, moe: bool, tp: int, ep: int) -> float:
    """Elements of one block on a rank: each tensor's tensor-parallel shard, and of the stacked
    experts the rank's E / ep (tensor parallelism leaves MoE layers whole)."""
    total = 0.0
    for t in block_tensors(shape, moe):
        local = 1
        for d in t.local_shape(tp):
            local *= d
        total += local / ep if t.expert else local
    return total


def _transient(shape: Shape, layout: Layout, job: Job, stage: int, params: int) -> float:
    """Short-lived buffers: logits at the loss, recompute working set, gradient reduction buffers."""
    counts = stage_counts(shape, layout)[stage]
    out = act.recompute_working_bytes(shape, layout, job)
    if job.fp8 and counts.blocks:
        out += fp8.working_bytes(shape, layout, job)
    if counts.last:
        out += act.logits_peak_bytes(shape, layout, job)
    if layout.dp * layout.cp == 1 or not counts.blocks:
        return out
    rb = DTYPE_BYTES[job.reduce_dtype]
    if layout.zero == 0:
        # one flat fp32 copy of every gradient (and its cast to reduce_dtype) for the all-reduce
        return out + params * (FP32 + (rb if rb != FP32 else 0))
    has_moe = counts.moe + counts.moe_ckpt > 0
    has_dense = counts.dense + counts.dense_ckpt > 0
    block = max(
        _block_numel(shape, True, layout.tp, layout.ep) if has_moe else 0,
        _block_numel(shape, False, layout.tp, layout.ep) if has_dense else 0,
    )
    c = job.compute_bytes
    if layout.zero == 3 and layout.pp == 1:
        out += 2 * _gathered_bytes(shape, layout, job, block)  # the gathered block and the prefetched next one
    return out + block * (c + rb)  # one block's whole gradient (compute dtype) and its reduce_dtype copy


def _gathered_bytes(shape: Shape, layout: Layout, job: Job, block: float) -> float:
    """One gathered block of ``block`` elements in the compute dtype, the converted linear
    weights in float8 when FSDP gathers float8 (precision.fp8_all_gather)."""
    if not job.fp8_all_gather:
        return block * job.compute_bytes
    low = fp8.converted_numel(shape, moe=shape.num_experts > 0, tp=layout.tp)
    return (block - low) * job.compute_bytes + low * fp8.FP8


def allowance(job: Job, *, working: float) -> float:
    """What a rank holds besides its tensors: on a GPU the profile's runtime reservation
    (CUDA context, libraries) and the caching allocator's fragmentation; on a CPU rank the
    process itself (``CPU_PROCESS_BYTES``, or the profile's reservation where larger) and
    the slack glibc's heap keeps (``CPU_HEAP_SLACK``), ``working`` being the activations
    and transient buffers."""
    process = max(job.profile.runtime_reserved_bytes, CPU_PROCESS_BYTES) if job.on_cpu else job.profile.runtime_reserved_bytes
    return process + slack_fraction(job) * working


def stage_memory(shape: Shape, layout: Layout, job: Job, stage: int, microbatches: int) -> StageMemory:
    """Full breakdown for pipeline ``stage`` (tp rank 0, ep rank 0, dp rank 0: the fullest shards)."""
    params, weights, grads, optimizer = model_states(shape, layout, stage, job)
    optimizer = muon.optimizer_bytes(optimizer, shape, layout, job, stage)
    activations = stage_activations(shape, layout, job, stage, microbatches)
    transient = _transient(shape, layout, job, stage, params)
    reserved = allowance(job, working=activations + transient)
    if job.on_cpu:
        reserved += cpu_step_bytes(shape, micro_batch=layout.micro_batch)
    mem = StageMemory(stage, params, weights, grads, optimizer, activations, transient, reserved)
    if layout.offload != "none" or layout.offload_activations:
        return device_memory(mem, shape, layout, job, block=largest_block(shape, layout, stage))
    return mem


def shard_numel(shape: Shape, layout: Layout, stage: int) -> int:
    """Elements of this rank's parameter shard under FSDP2 (the whole stage on a group of one)."""
    params = layout_rank_params(shape, layout, stage)
    group, expert_group = groups(layout)
    return params.numel if group == 1 else _cached_shard(params, group, expert_group)


def largest_block(shape: Shape, layout: Layout, stage: int) -> float:
    """Elements of this stage's largest block on one tp rank."""
    counts = stage_counts(shape, layout)[stage]
    moe = _block_numel(shape, True, layout.tp, layout.ep) if counts.moe + counts.moe_ckpt else 0
    dense = _block_numel(shape, False, layout.tp, layout.ep) if counts.dense + counts.dense_ckpt else 0
    return max(moe, dense)


def all_stages(shape: Shape, layout: Layout, job: Job, microbatches: int, *, every_stage: bool = True) -> list[StageMemory]:
    """Memory of every pipeline rank (or only of one rank per distinct stage content)."""
    stages = range(layout.pp) if every_stage else representative_stages(shape, layout)
    return [stage_memory(shape, layout, job, s, microbatches) for s in stages]


def most_loaded(stages: list[StageMemory]) -> StageMemory:
    """The stage whose rank needs the most memory."""
    return max(stages, key=lambda m: m.total)
