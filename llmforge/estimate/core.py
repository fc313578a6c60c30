"""One estimate: memory, pipeline, FLOPs, communication and step time of a layout.

``estimate(shape, layout, job)`` is pure arithmetic (no torch, no Hydra), fast
enough for the layout search; ``estimate_plan(plan)`` wraps it for a RunPlan.

Step time, for the slowest pipeline stage:

    t_mb   = the stage's kernels for one microbatch (llmforge.estimate.kernels:
             matmuls by shape, fused attention, memory-bound work by bytes (fused
             chains when the blocks are compiled), a per-kernel launch floor;
             rates from the hardware profile)
             + tensor-parallel and expert all-to-all time of that microbatch
    step   = m x t_mb + m x t_fill x bubble / (1 - bubble)
             (t_fill: the other stages' t_mb, their mean: the slowest stage waits for
             them as the pipeline fills and drains; a balanced pipeline's m x t_mb / (1 - bubble))
             + exposed data-parallel, pipeline and context-parallel communication
               (llmforge.estimate.comm: each kind's exposed part, as the backend overlaps it)
             + the compute lost to the hidden part (the profile's ``comm_sm_share`` of it:
               the collectives' kernels hold that share of the compute units while they run)
             + optimizer step and clip (memory-bound: 40 bytes per local parameter)
             + tensor parallelism's host time (llmforge.estimate.host: the step's DTensor
               calls at the profile's ``dtensor_op_us`` each, the clip's collectives)

``Estimate.terms`` lists the step term by term (matmul, attention, memory-bound,
launch floor, each communication kind's exposed seconds, bubble, the compute the hidden
communication slows (``comm_overlap``), optimizer, ``tp_host``).

``cluster.efficiency`` set to a number replaces the kernel model by a flat one:
every hardware FLOP at that share of peak, and 32 optimizer bytes per parameter.
MFU = model FLOPs / (step x devices x peak), against the peak of
``precision.param_dtype`` also with ``precision.fp8`` (whose converted matmuls run
at the FP8 peak: llmforge.estimate.fp8).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.choices import Offload
from llmforge.estimate import async_tp as atp
from llmforge.estimate import comm as cm
from llmforge.estimate import flops as fl
from llmforge.estimate import fp8, fp8_gain, muon
from llmforge.estimate import host as tph
from llmforge.estimate import kernels as kn
from llmforge.estimate.attention import Documents
from llmforge.estimate.inventory import Inventory, inventory
from llmforge.estimate.memory import StageMemory, all_stages, float8_numel, most_loaded, stage_activations
from llmforge.estimate.node import NodeMemory, node_memory
from llmforge.estimate.offload import HostUse, host_use, offloads
from llmforge.estimate.params import StageCounts, active_params, total_params
from llmforge.estimate.pipeline import bubble_fraction
from llmforge.estimate.shape import Job, Shape, from_plan
from llmforge.layout import Layout, selective_rebuilds
from llmforge.plan import RunPlan

OPTIMIZER_BYTES_PER_PARAM = 32  # flat model: AdamW reads param, grad, two moments, writes three; clip reads grads


@dataclass(frozen=True)
class Estimate:
    """Every figure ``llmforge estimate`` reports, for the most-loaded device."""

    shape: Shape
    layout: Layout
    job: Job
    microbatches: int
    params_total: int
    params_active: int
    stages: list[StageMemory]
    worst: StageMemory
    bubble: float
    model_flops: float
    hardware_flops: float
    comm: cm.Comm
    parts: dict[str, float]
    #: The slowest stage's microbatches' compute (``parts["compute"]``) by what bounds each kernel.
    compute: kn.Cost = kn.NONE
    #: The host side of CPU offload (llmforge.estimate.offload); None without offload.
    host: HostUse | None = None
    #: Host memory of the most-loaded node, all its ranks together (llmforge.estimate.node).
    node: NodeMemory | None = None

    @property
    def step_s(self) -> float:
        return sum(self.parts.values())

    @property
    def terms(self) -> dict[str, float]:
        """The step time term by term (they sum to ``step_s``): the slowest stage's compute by
        what bounds each kernel, then each exposed communication kind, the bubble, the optimizer."""
        c, kinds = self.compute, self.comm.kinds
        out = {"matmul": c.matmul, "attention": c.attention, "memory_bound": c.memory, "launch_floor": c.floor}
        out.update({f"{k}_exposed": kinds[k].exposed for k in cm.KINDS if k in kinds})
        out.update(bubble=self.parts["bubble"], comm_overlap=self.parts["overlap"], optimizer=self.parts["optimizer"])
        out.update({k: self.parts.get(k, 0.0) for k in ("tp_host", "fsdp_host", "collective_waits")})
        out.update({k: self.parts[k] for k in ("offload_copy", "cpu_optimizer") if k in self.parts})
        return out

    @property
    def fits_device(self) -> bool:
        return self.worst.total <= self.job.profile.memory_bytes

    @property
    def fits(self) -> bool:
        """On the most-loaded device and in the host memory of the most-loaded node."""
        return self.fits_device and (self.host is None or self.host.fits) and (self.node is None or self.node.fits)

    @property
    def headroom(self) -> float:
        """Device memory left (negative: missing) on the most-loaded device, bytes."""
        return self.job.profile.memory_bytes - self.worst.total

    @property
    def tokens_per_step(self) -> int:
        return self.job.global_batch * self.shape.seq

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        peak = self.job.profile.peak(self.job.param_dtype)
        return self.model_flops / (self.step_s * self.layout.world * peak)


def microbatches(layout: Layout, job: Job) -> int:
    """Microbatches of one step on each data-parallel rank."""
    return job.global_batch // (layout.micro_batch_size * layout.dp)


def estimate(
    shape: Shape,
    layout: Layout,
    job: Job,
    *,
    every_stage: bool = True,
    stages: list[StageMemory] | None = None,
    inv: Inventory | None = None,
) -> Estimate:
    """The full estimate of ``layout`` (assumed valid) for ``shape`` on ``job``.

    ``every_stage=False`` (the search) lists only one pipeline rank per distinct
    stage content; the most-loaded and the slowest rank are the same either way.
    ``inv``: the layout's inventory where the caller has it (the search), ``stages``: its memory."""
    inv = inventory(shape, layout) if inv is None else inv
    m = microbatches(layout, job)
    stages = all_stages(inv, job, m, every_stage=every_stage) if stages is None else stages
    worst = most_loaded(stages)
    times = {s: _stage_time(inv, job, s, m) for s in inv.representatives}
    slowest = max(times, key=lambda s: _stage_seconds(*times[s]))
    t_compute, t_collective = times[slowest]
    t_mb = t_compute.seconds + t_collective
    t_fill = _fill_seconds(inv, {s: _stage_seconds(*t) for s, t in times.items()}, slowest=slowest)
    comm = _communication(inv, job, m, slowest, t_mb)
    t_compute = t_compute.plus(_fsdp_copy_out(layout, job, comm).times(1 / m))
    host = _host_use(inv, job, worst, m, compute_s=m * t_compute.seconds)
    bubble = bubble_fraction(layout, m, w=fl.weight_grad_share(shape))
    step = _Step(m=m, compute=t_compute, collective=t_collective, t_fill=t_fill, bubble=bubble, comm=comm, host=host)
    parts = _step_parts(inv, job, step, worst=worst, slowest=slowest)
    tokens = job.global_batch * shape.seq
    return Estimate(
        shape=shape,
        layout=layout,
        job=job,
        microbatches=m,
        params_total=total_params(shape),
        params_active=active_params(shape),
        stages=stages,
        worst=worst,
        bubble=bubble,
        model_flops=fl.model_flops(shape, tokens),
        hardware_flops=fl.hardware_flops(shape, layout, tokens),
        comm=comm,
        parts=parts,
        compute=t_compute.times(m),
        host=host,
        node=_node_memory(inv, job, worst, host),
    )


@dataclass(frozen=True)
class _Step:
    """What the step time adds up: ``m`` microbatches of the slowest stage's compute and
    collectives (one microbatch's), the bubble (``t_fill``: the other stages' microbatch,
    which the slowest stage waits for as the pipeline fills and drains), the communication
    and the host's side."""

    m: int
    compute: kn.Cost
    collective: float
    t_fill: float
    bubble: float
    comm: cm.Comm
    host: HostUse | None


def _step_parts(inv: Inventory, job: Job, step: _Step, *, worst: StageMemory, slowest: int) -> dict[str, float]:
    """The step time by part (they sum to ``Estimate.step_s``)."""
    m, comm = step.m, step.comm
    parts = {
        "compute": m * step.compute.seconds,
        "tp_ep_comm": m * step.collective,
        "bubble": m * step.t_fill * step.bubble / (1 - step.bubble),
        "dp_comm": comm.exposed_of("dp"),
        "pp_comm": comm.exposed_of("pp"),
        "cp_comm": comm.exposed_of("cp"),
        "overlap": job.profile.comm_sm_share * sum(t.hidden for k, t in comm.kinds.items() if k != "tp"),  # async TP: copy engines
        "optimizer": _optimizer_seconds(inv, job, worst),
        "tp_host": _tp_host_seconds(inv, job, slowest, m),
        "fsdp_host": _fsdp_host_seconds(inv, job, slowest, m),
    }
    parts["collective_waits"] = tph.sync_seconds(
        inv.layout, job.profile, collectives=_blocking_collectives(inv, slowest, m, comm), between_s=parts["compute"] + parts["tp_host"]
    )
    if step.host is not None:
        parts.update(offload_copy=step.host.exposed_copy_s, cpu_optimizer=step.host.optimizer_s)
        if inv.layout.offload == Offload.STATES:
            parts["optimizer"] = 0.0  # the device runs no optimizer step
    return parts


def stage_peaks(inv: Inventory, job: Job) -> list[StageMemory]:
    """The memory half of ``estimate`` (one rank per distinct stage), for the search."""
    return all_stages(inv, job, microbatches(inv.layout, job), every_stage=False)


def step_floor(inv: Inventory, job: Job) -> float:
    """A lower bound of ``estimate(...).step_s``: the slowest stage's microbatches and the bubble,
    without data-parallel, pipeline and optimizer time (which only add). The search uses it to
    skip the rest of layouts that cannot reach its current top list."""
    m = microbatches(inv.layout, job)
    t_mb = [_stage_seconds(*_stage_time(inv, job, s, m)) for s in inv.representatives]
    bubble = bubble_fraction(inv.layout, m, w=fl.weight_grad_share(inv.shape))
    return m * max(t_mb) + m * min(t_mb) * bubble / (1 - bubble)


def _fill_seconds(inv: Inventory, t_mb: dict[int, float], *, slowest: int) -> float:
    """The microbatch seconds the slowest stage waits for per idle slot of its schedule: the mean
    of the other stages' (``t_mb`` by representative stage). Each slot of a balanced pipeline's
    bubble is one stage's microbatch; as the pipeline fills and drains, the slowest stage waits
    for the others' forwards and backwards, not for its own (a last stage holding the output
    layer and the loss waits less than it works)."""
    by_content = {inv.counts(r): seconds for r, seconds in t_mb.items()}
    others = [by_content[stage.counts] for stage in inv.stages if stage.index != slowest]
    return sum(others) / len(others) if others else t_mb[slowest]


def node_fits(inv: Inventory, job: Job, worst: StageMemory) -> bool:
    """Whether the most-loaded node's ranks fit its host memory (``worst``: the most-loaded
    device), without the rest of the estimate (the search)."""
    host = _host_use(inv, job, worst, microbatches(inv.layout, job), compute_s=0.0)
    return _node_memory(inv, job, worst, host).fits


def _stage_time(inv: Inventory, job: Job, stage: int, m: int) -> tuple[kn.Cost, float]:
    """(compute, TP/EP collective seconds) of one microbatch on ``stage``
    (``m`` microbatches per step: all but the first add to the gradients)."""
    shape, layout, counts = inv.shape, inv.layout, inv.counts(stage)
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    if job.efficiency is None:
        compute = _kernel_time(inv, job, stage, m)
    else:
        flops = fl.stage_hardware_flops_per_token(inv, counts) * tokens / layout.tp
        compute = kn.Cost(matmul=flops / (job.profile.peak(job.param_dtype) * job.efficiency))
    if job.fp8:
        compute = compute.plus(_fp8_cost(inv, job, counts, tokens))
    span, group = cm.spans(layout), cm.groups(layout)
    collective = cm.seconds(job, cm.tp_bytes(shape, layout, job, layers=counts.blocks, microbatches=1), span["tp"], group["tp"])
    moe = counts.moe + counts.moe_ckpt
    collective += cm.seconds(job, cm.ep_bytes(shape, layout, job, moe_layers=moe, microbatches=1), span["ep"], group["ep"])
    latency = cm.critical_latency(
        shape, layout, job, layers=counts.blocks, moe_layers=moe, microbatches=1, first=counts.first, last=counts.last
    )
    overlap = _async_tp(inv, job, stage)
    return compute.plus(overlap.cost), collective + sum(latency.values()) - overlap.hidden


def _async_tp(inv: Inventory, job: Job, stage: int) -> atp.AsyncTP:
    """One microbatch of ``stage`` under ``parallel.async_tp``: the TP seconds hidden and the compute added."""
    counts = inv.counts(stage)
    return atp.async_tp(inv.shape, inv.layout, job, attention_layers=counts.blocks, mlp_layers=counts.dense + counts.dense_ckpt)


def _fp8_cost(inv: Inventory, job: Job, counts: StageCounts, tokens: float) -> kn.Cost:
    """What FP8 changes in one microbatch's compute: the converted matmuls in float8 instead of
    16-bit, plus their casts and amax reductions (llmforge.estimate.fp8_gain prices both by the
    kernel model; with a flat ``cluster.efficiency``, the FP8 peak and the casts' bytes). A profile
    without FP8 (refused by the plan unless emulated) runs them at the 16-bit peak."""
    if not job.profile.has_fp8:
        return kn.NONE
    layout = inv.layout
    shard = layout.dp_shard * layout.cp if job.fp8_all_gather and layout.zero > 0 else 1
    if job.efficiency is None:
        out = kn.NONE
        for moe, plain, ckpt in ((False, counts.dense, counts.dense_ckpt), (True, counts.moe, counts.moe_ckpt)):
            for n, recomputed in ((plain, False), (ckpt, True)):
                if n:
                    out = out.plus(fp8_gain.block_delta(inv.shape, layout, job, moe=moe, recomputed=recomputed, shard=shard).times(n))
        return out
    f8 = fp8.stage_flops_per_token(inv, counts) * tokens / layout.tp
    faster = f8 / (job.profile.peak(job.param_dtype) * job.efficiency) - f8 / (job.profile.peak("fp8") * job.efficiency)
    casts = fp8.stage_cast_seconds(inv, job, counts, tokens, shard=shard, fused=job.compile)
    return kn.Cost(matmul=-faster, memory=casts)


def _kernel_time(inv: Inventory, job: Job, stage: int, m: int) -> kn.Cost:
    """One microbatch's kernels on ``stage`` (llmforge.estimate.kernels), of ``m`` per step (all
    but the first add to the gradients); kept in the inventory's memo, as layouts that differ in
    the rest (ZeRO, schedule, HSDP, other stages of the same content) run the same kernels."""
    layout, counts = inv.layout, inv.counts(stage)
    key = ("kernels", counts, m, layout.micro_batch_size, layout.cp, layout.tp, layout.sequence_parallel, layout.ep, layout.recompute)
    cost = inv.memo.get(key)
    if not isinstance(cost, kn.Cost):
        cost = inv.memo[key] = _stage_kernels(inv.shape, layout, job, counts, (m - 1) / m)
    return cost


def _stage_kernels(shape: Shape, layout: Layout, job: Job, counts: StageCounts, accumulate: float) -> kn.Cost:
    sp, c, mixed, fused = kn.speeds(job), job.compute_bytes, job.mixed, job.compile
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    spd = layout.tp if layout.sequence_parallel else 1
    out = kn.NONE
    for n, moe, applies in (
        (counts.dense, False, False),
        (counts.moe, True, False),
        (counts.dense_ckpt, False, True),
        (counts.moe_ckpt, True, True),
    ):
        if n:
            k = kn.block_kernels(shape, t=tokens, tp=layout.tp, sp=spd, ep=layout.ep, c=c, mixed=mixed, moe=moe, fused=fused)
            mode = layout.recompute if applies else "none"
            rebuilds = selective_rebuilds(tp=layout.tp, moe=moe, compiled=fused)
            out = out.plus(kn.block_cost(sp, k, mode=mode, mixed=mixed, c=c, accumulate=accumulate, rebuilds=rebuilds).times(n))
    if counts.first or counts.last:
        ends = Layout(micro_batch_size=layout.micro_batch_size, cp=layout.cp, tp=layout.tp)
        out = out.plus(kn.ends_cost(sp, shape, ends, c=c, mixed=mixed, first=counts.first, last=counts.last, accumulate=accumulate))
    return out


def _optimizer_seconds(inv: Inventory, job: Job, worst: StageMemory) -> float:
    """The optimizer step and clip on the most-loaded rank (memory-bound)."""
    params = worst.optimizer / muon.state_bytes_per_param(inv, job, worst.stage)
    if job.efficiency is not None:
        adam = OPTIMIZER_BYTES_PER_PARAM * params / job.profile.memory_bandwidth
    else:
        adam = kn.optimizer_cost(kn.speeds(job), int(params), 12 * inv.counts(worst.stage).blocks + 4).seconds
    return adam + muon.step_seconds(inv, job, worst.stage)


def _communication(inv: Inventory, job: Job, m: int, stage: int, t_mb: float) -> cm.Comm:
    """Every kind of communication of ``stage`` per step (``t_mb``: one microbatch's compute and collectives)."""
    shape, layout, counts = inv.shape, inv.layout, inv.counts(stage)
    span, group = cm.spans(layout), cm.groups(layout)
    nblocks = counts.blocks
    params = inv.stages[stage].params
    t_fwd = t_mb / 3  # forward share of a microbatch's compute (backward is twice the forward)
    embedding = shape.vocab * shape.hidden // layout.tp if counts.first else 0
    gathered8 = float8_numel(inv, counts) if job.fp8_all_gather and layout.zero > 0 else 0.0
    kinds = cm.dp_traffic(
        layout,
        job,
        dense=params.dense_numel,
        expert=params.expert_numel,
        microbatches=m,
        blocks=nblocks,
        t_fwd=t_fwd,
        t_bwd=t_mb - t_fwd,
        span=span["dp"],
        last_bucket=embedding,
        float8=gathered8,
    )
    pp_total, pp_one = cm.pp_bytes(shape, layout, job, microbatches=m)
    if pp_total:
        one_s = cm.seconds(job, pp_one, span["pp"]) + cm.hops_seconds(job, 1)
        pp_s = pp_total / pp_one * one_s
        kinds["pp"] = cm.Traffic(pp_total, pp_s, min(pp_s, 2 * (layout.pp - 1) * layout.pp_virtual_stages * one_s))
    moe = counts.moe + counts.moe_ckpt
    latency = cm.critical_latency(shape, layout, job, layers=nblocks, moe_layers=moe, microbatches=m, first=counts.first, last=counts.last)
    hidden = {"tp": m * _async_tp(inv, job, stage).hidden, "ep": 0.0}
    for kind, nbytes in (
        ("tp", cm.tp_bytes(shape, layout, job, layers=nblocks, microbatches=m)),
        ("ep", cm.ep_bytes(shape, layout, job, moe_layers=moe, microbatches=m)),
    ):
        if nbytes:  # on the critical path: the next op needs the result (but what async TP hides)
            t = cm.seconds(job, nbytes, span[kind], group[kind]) + latency[kind]
            kinds[kind] = cm.Traffic(nbytes, t, t - hidden[kind])
    cp_b = cm.cp_bytes(shape, layout, job, layers=nblocks, microbatches=m)
    if cp_b:
        t_cp = cm.seconds(job, cp_b, span["cp"], group["cp"])
        kinds["cp"] = cm.Traffic(cp_b, t_cp, max(0.0, t_cp - m * t_mb * _attention_share(shape)))
    return cm.Comm(kinds={k: kinds[k] for k in cm.KINDS if k in kinds})


def _fsdp_copy_out(layout: Layout, job: Job, comm: cm.Comm) -> kn.Cost:
    """FSDP2 copies each gathered unit out of the all-gather buffer into its parameters on the
    compute stream (``foreach_all_gather_copy_out``): every gathered byte read and written once."""
    gathers = comm.kinds.get("dp_all_gather")
    if gathers is None or job.efficiency is not None:
        return kn.NONE
    group = max(2, layout.dp * layout.cp // layout.dp_replicate)
    return kn.speeds(job).memory(2 * gathers.bytes * group / (group - 1), kernels=1)


def _attention_share(shape: Shape) -> float:
    f = fl.block_flops(shape, moe=False)
    return f.attention / f.forward


def _host_use(inv: Inventory, job: Job, worst: StageMemory, m: int, *, compute_s: float) -> HostUse | None:
    """The host side of CPU offload for the most-loaded rank (None without offload)."""
    if not offloads(inv.layout):
        return None
    activations = stage_activations(inv, job, worst.stage, m)
    return host_use(inv, job, stage=worst.stage, activations=activations, microbatches=m, compute_s=compute_s)


def _node_memory(inv: Inventory, job: Job, worst: StageMemory, host: HostUse | None) -> NodeMemory:
    """Host memory of the most-loaded node (``worst``: its most-loaded device)."""
    offloaded = 0.0 if host is None else host.states_bytes + host.activations_bytes
    shard = inv.stages[worst.stage].shard
    return node_memory(
        inv.shape, inv.layout, job, device_total=worst.total, shard=shard, offloaded=offloaded, largest=inv.largest_parameter
    )


def _tp_host_seconds(inv: Inventory, job: Job, stage: int, m: int) -> float:
    """Host time of the step's DTensor calls on ``stage``, and the gradient clip's collectives'
    fixed part (``llmforge.estimate.host``): nothing without tensor parallelism."""
    layout = inv.layout
    if layout.tp == 1:
        return 0.0
    hops = layout.tp - 1 if layout.sequence_parallel else cm.all_reduce_hops(layout.tp)
    clip = cm.hops_seconds(job, hops) * tph.CLIP_COLLECTIVES
    return clip + tph.dtensor_seconds(inv.shape, layout, job.profile, inv.counts(stage), microbatches=m)


def _fsdp_host_seconds(inv: Inventory, job: Job, stage: int, m: int) -> float:
    """FSDP2's host work in one step on ``stage`` (``llmforge.estimate.host.fsdp_host_seconds``)."""
    layout, counts, params = inv.layout, inv.counts(stage), inv.stages[stage].params
    gathers, scatters = cm.fsdp_collectives(zero=layout.zero, pp=layout.pp, blocks=counts.blocks, microbatches=m)
    tensors = len(params.dense) + len(params.expert)
    return tph.fsdp_host_seconds(layout, job.profile, blocks=counts.blocks, microbatches=m, collectives=gathers + scatters, params=tensors)


def _blocking_collectives(inv: Inventory, stage: int, m: int, comm: cm.Comm) -> int:
    """Collectives the host of a rank on ``stage`` blocks on in one step (``llmforge.estimate.host``):
    tensor parallelism's, the step's own and the data-parallel gradient reduction's."""
    counts = inv.counts(stage)
    tp = tph.tp_collectives(inv.layout, layers=counts.blocks, first=counts.first, last=counts.last, microbatches=m, per_step=True)
    return tp + tph.step_collectives(inv.layout) + comm.waits_of("dp")


def _stage_seconds(compute: kn.Cost, collective: float) -> float:
    return compute.seconds + collective


def estimate_plan(plan: RunPlan, *, documents: Documents | None = None) -> Estimate:
    """The estimate of a built RunPlan (``documents``: see ``llmforge.estimate.shape.from_plan``)."""
    return estimate(*from_plan(plan, documents=documents))
