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

from llmforge.config.choices import Offload
from llmforge.config.dtypes import DTYPE_BYTES
from llmforge.estimate import activations as act
from llmforge.estimate import fp8, muon
from llmforge.estimate.allocator import slack_fraction
from llmforge.estimate.cpu_memory import cpu_step_bytes
from llmforge.estimate.inventory import Inventory
from llmforge.estimate.offload import device_memory
from llmforge.estimate.params import StageCounts
from llmforge.estimate.phases import Working, live_at_peak
from llmforge.estimate.pipeline import inflight_microbatches
from llmforge.estimate.shape import Job
from llmforge.estimate.stage_memory import StageMemory
from llmforge.layout import Layout

__all__ = ["StageMemory", "all_stages", "allowance", "model_states", "most_loaded", "stage_activations", "stage_memory"]

FP32 = 4
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
#: A CPU rank's process before its model: the interpreter, torch, llmforge, gloo and the
#: data loader, resident (rank 0 of a tiny dp8 run peaks at 0.37 GiB, 15 MiB of it tensors).
CPU_PROCESS_BYTES = int(0.35 * 2**30)


def model_states(inv: Inventory, stage: int, job: Job) -> tuple[int, float, float, float]:
    """(parameters on this rank, weight bytes, gradient bytes, optimizer bytes) at the step's peak.

    ZeRO 1-3 are FSDP2 ``fully_shard`` (llmforge.parallel.data): the fp32 master
    weights and the AdamW moments are sharded; the compute copy (in
    ``precision.param_dtype``) stays whole through the step under ZeRO 1 and 2 (and
    any stage under a pipeline, whose schedule keeps it until the last
    microbatch) and exists one block at a time under ZeRO 3 (a transient buffer);
    ZeRO 1 (and any stage under a pipeline) accumulates whole gradients in
    ``precision.reduce_dtype``, ZeRO 2 and 3 keep only an fp32 gradient shard.
    """
    layout = inv.layout
    full = inv.stages[stage].params.numel
    if layout.zero == 0 or layout.dp * layout.cp == 1:
        return full, FP32 * full, FP32 * full, ADAM_STATE_BYTES * full
    shard = inv.stages[stage].shard
    whole_copy = layout.zero < 3 or layout.pp > 1
    weights = FP32 * shard + (job.compute_bytes * full - _float8_saving(inv, job, stage) if whole_copy else 0)
    whole_grads = layout.zero == 1 or layout.pp > 1
    grads = DTYPE_BYTES[job.reduce_dtype] * (full + _embedding_grad_excess(inv, stage)) if whole_grads else FP32 * shard
    return full, weights, grads, ADAM_STATE_BYTES * shard


def _embedding_grad_excess(inv: Inventory, stage: int) -> float:
    """Elements the accumulated gradient of a vocab-parallel embedding holds beyond its shard.

    DTensor has no row-sharded strategy for the embedding's backward: on each tp rank the
    weight's gradient comes out as a Partial of the whole table (vocab x hidden), and FSDP2
    accumulates it so across microbatches (in ``reduce_dtype``) until the last one reduces it
    to the rank's rows. The rehearsal of llama-405b's first stage holds it (7.8 GiB in fp32).
    A tied table that the same stage's output layer also uses gets its rows' gradient from
    that matmul too, and the sum keeps the rows (llmforge.train.footprint measures it so)."""
    shape, layout, counts = inv.shape, inv.layout, inv.counts(stage)
    if layout.tp == 1 or not counts.first or (shape.tie_embeddings and counts.last):
        return 0.0
    return shape.vocab * shape.hidden * (layout.tp - 1) / layout.tp


def float8_numel(inv: Inventory, counts: StageCounts) -> float:
    """Elements of a stage's weights that FP8 converts, on one tensor-parallel rank."""
    low = (counts.dense + counts.dense_ckpt) * inv.dense.converted_numel
    return low + ((counts.moe + counts.moe_ckpt) * inv.moe.converted_numel if inv.moe is not None else 0.0)


def _float8_saving(inv: Inventory, job: Job, stage: int) -> float:
    """Bytes a whole compute copy saves when FSDP gathers the converted weights as float8."""
    if not job.fp8_all_gather:
        return 0.0
    return float8_numel(inv, inv.counts(stage)) * (job.compute_bytes - fp8.FP8)


def stage_activations(inv: Inventory, job: Job, stage: int, microbatches: int) -> float:
    """Saved activations on this stage's rank at the schedule's peak."""
    counts = inv.counts(stage)
    key = _activations_key(inv, job, "stage", counts)
    per_mb = inv.memo.get(key)
    if not isinstance(per_mb, float):
        per_mb = inv.memo[key] = act.stage_bytes_per_microbatch(inv, job, counts)
    return per_mb * inflight_microbatches(inv.layout, stage=stage, microbatches=microbatches)


def _recompute_working_bytes(inv: Inventory, job: Job) -> float:
    key = _activations_key(inv, job, "recompute working set")
    found = inv.memo.get(key)
    if not isinstance(found, float):
        found = inv.memo[key] = act.recompute_working_bytes(inv, job)
    return found


def _activations_key(inv: Inventory, job: Job, *what: object) -> tuple[object, ...]:
    """The layout fields activations depend on (the memo serves one job): layouts that differ in
    the rest (ZeRO 1-3, schedule, data-parallel degree) keep the same activations per microbatch."""
    lay = inv.layout
    gathered = act.weights_gathered(lay, job)
    return (
        "activations",
        *what,
        lay.tp,
        lay.sequence_parallel,
        lay.async_tp,
        lay.ep,
        lay.cp,
        lay.micro_batch_size,
        lay.recompute,
        gathered,
    )


def _working(inv: Inventory, job: Job, stage: int, params: int) -> Working:
    """Short-lived buffers by when they live: logits at the loss, recompute working set,
    float8 casts, gradient reduction buffers, autocast's cache, the embedding's gradient."""
    shape, layout, counts = inv.shape, inv.layout, inv.counts(stage)
    reduce, at_end = _reduce_bytes(inv, job, stage, params)
    offloaded = layout.offload != Offload.NONE or layout.offload_activations  # its model moves the items itself
    return Working(
        loss=act.logits_peak_bytes(shape, layout, job) if counts.last else 0.0,
        recompute=max(0.0, _recompute_working_bytes(inv, job)),  # negative where selective keeps more than none
        fp8=fp8.working_bytes(inv, job) if job.fp8 and counts.blocks else 0.0,
        reduce=reduce,
        reduce_at_end=at_end,
        cached=0.0 if offloaded else act.cached_copies_bytes(shape, layout, job, counts),
        embedding=shape.vocab * shape.hidden * FP32 if shape.tie_embeddings and counts.first and counts.last else 0.0,
        kept_to_end=act.logits_bytes(shape, layout, job) if counts.last and layout.pp == 1 else 0.0,
        pipelined_embedding=_pipelined_embedding_bytes(inv, stage),
    )


def _pipelined_embedding_bytes(inv: Inventory, stage: int) -> float:
    """A pipeline's first stage under tp without FSDP: each microbatch's embedding gradient
    (a Partial of the whole fp32 table, ``_embedding_grad_excess``) and the new sum autograd
    accumulates it into, out of place, live while other microbatches' activations are kept
    (the 175B rehearsal: 4.78 GiB). Under FSDP2 the sum is taken in place in its own buffer
    (not counted here)."""
    layout = inv.layout
    excess = _embedding_grad_excess(inv, stage)
    sharded = layout.zero > 0 and layout.dp * layout.cp > 1
    if layout.pp == 1 or not excess or sharded:
        return 0.0
    return 2 * excess * layout.tp / (layout.tp - 1) * FP32


def _reduce_bytes(inv: Inventory, job: Job, stage: int, params: int) -> tuple[float, bool]:
    """Gradient reduction buffers (and ZeRO 3's gathers), and whether they fill up only as the
    backward ends (ZeRO 0's flat copies)."""
    layout = inv.layout
    if layout.dp * layout.cp == 1 or not inv.counts(stage).blocks:
        return 0.0, False
    rb = DTYPE_BYTES[job.reduce_dtype]
    if layout.zero == 0:
        # one flat fp32 copy of every gradient (and its cast to reduce_dtype) for the all-reduce
        return params * (FP32 + (rb if rb != FP32 else 0)), True
    block = inv.largest_block(stage)
    out = 0.0
    if layout.zero == 3 and layout.pp == 1:
        out += 2 * _gathered_bytes(inv, job, block)  # the gathered block and the prefetched next one
    return out + block * (job.compute_bytes + rb), False  # one block's whole gradient (compute dtype) and its reduce_dtype copy


def grads_meet_activations(layout: Layout, microbatches: int) -> bool:
    """Whether a microbatch's activations meet the gradients of earlier ones (llmforge.estimate.phases):
    gradient accumulation, a pipeline schedule, or an offload model that counts them together."""
    return microbatches > 1 or layout.pp > 1 or layout.offload != Offload.NONE or layout.offload_activations


def _gathered_bytes(inv: Inventory, job: Job, block: float) -> float:
    """One gathered block of ``block`` elements in the compute dtype, the converted linear
    weights in float8 when FSDP gathers float8 (precision.fp8_all_gather)."""
    if not job.fp8_all_gather:
        return block * job.compute_bytes
    low = inv.block(inv.moe is not None).converted_numel
    return (block - low) * job.compute_bytes + low * fp8.FP8


def allowance(job: Job, *, working: float) -> float:
    """What a rank holds besides its tensors: on a GPU the profile's runtime reservation
    (CUDA context, libraries) and the caching allocator's fragmentation; on a CPU rank the
    process itself (``CPU_PROCESS_BYTES``, or the profile's reservation where larger) and
    the slack glibc's heap keeps (``CPU_HEAP_SLACK``), ``working`` being the activations
    and transient buffers."""
    process = max(job.profile.runtime_reserved_bytes, CPU_PROCESS_BYTES) if job.on_cpu else job.profile.runtime_reserved_bytes
    return process + slack_fraction(job) * working


def stage_memory(inv: Inventory, job: Job, stage: int, microbatches: int) -> StageMemory:
    """Full breakdown for pipeline ``stage`` (tp rank 0, ep rank 0, dp rank 0: the fullest shards)."""
    layout = inv.layout
    params, weights, grads, optimizer = model_states(inv, stage, job)
    optimizer = muon.optimizer_bytes(optimizer, inv, job, stage)
    saved = stage_activations(inv, job, stage, microbatches)
    working = _working(inv, job, stage, params)
    live = live_at_peak(grads=grads, activations=saved, working=working, concurrent=grads_meet_activations(layout, microbatches))
    reserved = allowance(job, working=live.activations + live.transient)
    if job.on_cpu:
        reserved += cpu_step_bytes(inv.shape, micro_batch=layout.micro_batch_size)
    mem = StageMemory(stage, params, weights, live.grads, optimizer, live.activations, live.transient, reserved, peak=live.when)
    if layout.offload != Offload.NONE or layout.offload_activations:
        return device_memory(mem, inv, job)
    return mem


def all_stages(inv: Inventory, job: Job, microbatches: int, *, every_stage: bool = True) -> list[StageMemory]:
    """Memory of every pipeline rank (or only of one rank per distinct stage content)."""
    stages = range(inv.layout.pp) if every_stage else inv.representatives
    return [stage_memory(inv, job, s, microbatches) for s in stages]


def most_loaded(stages: list[StageMemory]) -> StageMemory:
    """The stage whose rank needs the most memory."""
    return max(stages, key=lambda m: m.total)
