"""``llmforge estimate --search``: every valid layout of a model on a cluster, ranked by speed.

The search enumerates dp x tp x pp x cp x ep, ZeRO stage, HSDP replicas (shard groups of
whole nodes on multi-node clusters), micro batch, recompute mode, pipeline schedule with
its virtual stages, and sequence parallel, under the
plan's validation rules (tp divides heads, kv heads, ffn and vocab; layers split
evenly over pp x v; the global batch splits into whole microbatches, at least
pp of them for the schedules that must fill the pipe; ep divides the experts
and the data-parallel group). tp (and tp x ep) stay inside a node.

It prunes what cannot win, and says so:

- options dominated under the estimate's own model: ``gpipe`` and ``looped_bfs``
  are left out (same bubble as ``1f1b`` / ``interleaved_1f1b``, more activations
  held). Sequence parallel is tried both ways: it saves memory without recompute
  but, with selective recompute, keeps the gathered fp32 norm outputs;
- for one structure, micro batches are tried smallest first and recompute modes
  none -> selective -> full: the first mode that fits is kept (more recompute
  only adds FLOPs), and once even full recompute does not fit, larger micro
  batches are skipped;
- layouts the backend cannot run are not proposed: cp > 1 with pp > 1 or with
  an MoE model, HSDP with cp or ep, selective recompute with ep > 1 under ZeRO 1-3.

CPU offload (``parallel.offload=states``, then also ``parallel.offload_activations``) is
tried only when no layout fits in device memory, and the result says so.

``precision.fp8`` is part of the job, not of the layout: the search ranks layouts for
the precision asked (run it with and without ``precision=fp8`` to compare).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from llmforge.config.choices import Offload, Recompute, Schedule
from llmforge.config.schema import RunConfig
from llmforge.errors import UserError
from llmforge.estimate.attention import Documents
from llmforge.estimate.core import Estimate, estimate, node_fits, stage_peaks, step_floor
from llmforge.estimate.inventory import Inventories
from llmforge.estimate.memory import most_loaded
from llmforge.estimate.shape import Job, Shape, from_plan
from llmforge.estimate.text import gib
from llmforge.hardware import known_profiles
from llmforge.layout import Layout, selective_recompute_runs
from llmforge.plan import RunPlan

MAX_VIRTUAL = 8


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchResult:
    """The ranked layouts that fit, and what the search did."""

    ranked: list[Estimate]
    evaluated: int
    fitting: int
    seconds: float
    world: int
    smallest: Estimate | None = None
    suggestions: list[str] = field(default_factory=list)
    #: Set when only layouts with CPU offload fit: what they offload, in words.
    offloaded: str = ""

    @property
    def rate(self) -> float:
        return self.evaluated / self.seconds if self.seconds > 0 else float("inf")


def tp_options(shape: Shape, node_size: int) -> list[int]:
    """Tensor-parallel degrees inside a node that divide heads, kv heads, ffn, vocab and seq (for SP)."""
    return [
        t for t in divisors(node_size) if not (shape.heads % t or shape.kv_heads % t or shape.ffn % t or shape.vocab % t or shape.seq % t)
    ]


def ep_options(shape: Shape, *, dp: int, tp: int, node_size: int) -> list[int]:
    """Expert-parallel degrees dividing the experts and dp, with tp x ep inside a node."""
    if shape.num_experts == 0:
        return [1]
    return [e for e in divisors(shape.num_experts) if dp % e == 0 and tp * e <= node_size]


def cp_options(shape: Shape, *, pp: int, world: int) -> list[int]:
    """Context-parallel degrees the backend runs: with pp=1 and a dense model, those
    whose 2 x cp load-balanced chunks divide the sequence."""
    if pp > 1 or shape.num_experts > 0:
        return [1]
    return [c for c in divisors(world) if c == 1 or shape.seq % (2 * c) == 0]


def replicate_options(*, dp: int, tp: int, cp: int, ep: int, zero: int, node_size: int) -> list[int]:
    """HSDP replica counts worth trying: 1 (ZeRO over all of dp), and, with ZeRO 1-3 on
    several nodes, each count whose shard group fills whole nodes (tp x dp / r ranks a
    multiple of the node), so the gathers stay on NVLink and only the replica all-reduce
    crosses the network. The backend runs HSDP without ep and cp."""
    if zero == 0 or cp > 1 or ep > 1 or tp * dp <= node_size:
        return [1]
    return [1] + [r for r in divisors(dp) if r > 1 and (tp * (dp // r)) % node_size == 0]


def schedule_options(shape: Shape, pp: int) -> list[tuple[Schedule, int]]:
    """(schedule, virtual stages) worth trying for pp stages."""
    if pp == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    out = [(Schedule.ONE_F_ONE_B, 1)]
    per_rank = shape.num_layers // pp
    for v in divisors(per_rank):
        if 2 <= v <= MAX_VIRTUAL:
            out += [(Schedule.INTERLEAVED_1F1B, v), (Schedule.ZB_INTERLEAVED, v)]
    if per_rank % 2 == 0:
        out.append((Schedule.ZBV, 2))
    return out


def _micro_batches(job: Job, dp: int, pp: int, schedule: Schedule) -> Iterator[int]:
    if job.global_batch % dp:
        return
    per_rank = job.global_batch // dp
    for mb in divisors(per_rank):
        m = per_rank // mb
        if pp > 1 and m < pp:
            continue
        if pp > 1 and schedule not in (Schedule.ONE_F_ONE_B, Schedule.GPIPE) and m % pp:
            continue
        yield mb


def structures(shape: Shape, job: Job, world: int) -> Iterator[Layout]:
    """Every (dp, tp, pp, cp, ep, zero, schedule, v, sp) the rules allow, micro batch unset."""
    node = min(job.node_size, world)
    for tp in tp_options(shape, node):
        for pp, cp in ((p, c) for p in divisors(shape.num_layers) for c in cp_options(shape, pp=p, world=world)):
            if world % (tp * pp * cp):
                continue
            dp = world // (tp * pp * cp)
            for ep in ep_options(shape, dp=dp, tp=tp, node_size=node):
                for schedule, v in schedule_options(shape, pp):
                    for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                        for r in replicate_options(dp=dp, tp=tp, cp=cp, ep=ep, zero=zero, node_size=node):
                            for sp in (True, False) if tp > 1 else (False,):
                                yield Layout(
                                    dp=dp,
                                    tp=tp,
                                    pp=pp,
                                    cp=cp,
                                    ep=ep,
                                    zero=zero,
                                    sequence_parallel=sp,
                                    pp_schedule=schedule,
                                    pp_virtual_stages=v,
                                    dp_replicate=r,
                                )


_FIELDS = tuple(Layout.__dataclass_fields__)


#: An entry of the top list: (rank key, minus its enumeration order, the estimate); a min-heap.
Kept = tuple[tuple[float, float], int, Estimate]


@dataclass
class _Counters:
    """What the search counts as it goes, and the layout needing the least device memory."""

    evaluated: int = 0
    fitting: int = 0
    smallest_peak: float = float("inf")
    smallest: Layout | None = None


def _recompute_modes(structure: Layout) -> tuple[str, ...]:
    """Least recompute first, leaving out selective where the backend does not run it."""
    if selective_recompute_runs(ep=structure.ep, zero=structure.zero):
        return ("none", "selective", "full")
    return ("none", "full")


def _evaluate(inventories: Inventories, job: Job, structure: Layout, keep: list[Kept], top: int, counters: _Counters) -> None:
    """Micro batches smallest first; per micro batch the least recompute that fits."""
    shape = inventories.shape
    base = {f: getattr(structure, f) for f in _FIELDS}
    capacity = job.profile.memory_bytes
    tokens = job.global_batch * shape.seq
    for mb in _micro_batches(job, structure.dp, structure.pp, structure.pp_schedule):
        fitted = False
        for recompute in _recompute_modes(structure):
            layout = Layout(**{**base, "micro_batch_size": mb, "recompute": recompute})
            inv = inventories.of(layout)
            stages = stage_peaks(inv, job)
            worst = most_loaded(stages)
            peak = worst.total
            counters.evaluated += 1
            if peak < counters.smallest_peak:
                counters.smallest_peak, counters.smallest = peak, layout
            if peak <= capacity and node_fits(inv, job, worst):
                counters.fitting += 1
                fitted = True
                if len(keep) >= top and tokens / step_floor(inv, job) < keep[0][0][0]:
                    break  # cannot enter the top list even with no communication at all
                _push(keep, estimate(shape, layout, job, stages=stages, inv=inv), top, counters.evaluated)
                break
        if not fitted:
            return


def _rank_key(est: Estimate) -> tuple[float, float]:
    return (round(est.tokens_per_s, 6), -est.worst.total)


def _push(keep: list[Kept], est: Estimate, top: int, seq: int) -> None:
    item: Kept = (_rank_key(est), -seq, est)  # full ties: the earlier enumerated (smaller degrees) first
    if len(keep) < top:
        heapq.heappush(keep, item)
    elif item[:2] > keep[0][:2]:
        heapq.heapreplace(keep, item)


def search(shape: Shape, job: Job, *, world: int, top: int = 5) -> SearchResult:
    """Rank every valid layout of ``world`` devices that fits, fastest first (ties: less memory).
    Only when none fits on the devices are layouts with CPU offload tried (``offloaded``)."""
    start = time.perf_counter()
    keep: list[Kept] = []
    counters = _Counters()
    inventories = Inventories(shape)  # the search's one memo: an inventory per layout structure
    for structure in structures(shape, job, world):
        _evaluate(inventories, job, structure, keep, max(top, 2), counters)
    offloaded = ""
    if not keep and not job.fp8:  # the plan refuses offload with precision.fp8
        for offload in OFFLOAD_STEPS:
            for structure in offload_structures(shape, job, world, **offload):
                _evaluate(inventories, job, structure, keep, max(top, 2), counters)
            if keep:
                offloaded = "the model states (fp32 weights, gradients, AdamW moments)" + (
                    " and the saved activations" if len(offload) > 1 else ""
                )
                break
    ranked = [e for _, _, e in sorted(keep, key=lambda x: x[:2], reverse=True)]
    lean = counters.smallest
    result = SearchResult(
        ranked=ranked,
        evaluated=counters.evaluated,
        fitting=counters.fitting,
        seconds=time.perf_counter() - start,
        world=world,
        smallest=estimate(shape, lean, job, inv=inventories.of(lean)) if lean is not None else None,
    )
    if offloaded:
        result.offloaded = (
            f"No layout fits in device memory alone; these keep {offloaded} in host memory "
            f"(parallel.offload=states{' parallel.offload_activations=true' if 'activations' in offloaded else ''}) "
            "and step the optimizer on the CPU."
        )
    if not ranked:
        result.suggestions = suggestions(shape, job, world=world, smallest=result.smallest)
    return result


#: What the search offloads when nothing fits on the devices, least first.
OFFLOAD_STEPS = ({"offload": Offload.STATES}, {"offload": Offload.STATES, "offload_activations": True})


def offload_structures(shape: Shape, job: Job, world: int, *, offload: Offload, offload_activations: bool = False) -> Iterator[Layout]:
    """The structures that can offload (FSDP2: ZeRO 1-3; on a data-parallel group of one, ZeRO 3's
    code path with the same FSDP2 units), with the offload set."""
    for structure in structures(shape, job, world):
        if structure.zero == 0 and structure.dp * structure.cp > 1:
            continue
        zero = structure.zero or 1
        yield replace(structure, zero=zero, offload=offload, offload_activations=offload_activations)


def minimum_devices(shape: Shape, job: Job, *, world: int, limit: int = 16384) -> tuple[int, int, Layout] | None:
    """The fewest devices (powers of two above ``world``, full nodes of the profile) on which
    a ZeRO-3 + full-recompute layout fits: (devices, global batch it needs, layout)."""
    node = job.profile.devices_per_node
    n = world * 2
    while n <= limit:
        batch = max(job.global_batch, n)  # each data-parallel rank needs a sequence
        scaled = replace(job, nodes=max(1, n // node), devices_per_node=min(n, node), global_batch=batch)
        inventories = Inventories(shape)  # (one memo per job)
        for structure in structures(shape, scaled, n):
            if structure.zero != (3 if structure.dp > 1 else 0) or structure.pp_schedule != Schedule.ONE_F_ONE_B:
                continue
            for mb in list(_micro_batches(scaled, structure.dp, structure.pp, structure.pp_schedule))[:1]:
                layout = Layout(**{**{f: getattr(structure, f) for f in _FIELDS}, "micro_batch_size": mb, "recompute": Recompute.FULL})
                inv = inventories.of(layout)
                worst = most_loaded(stage_peaks(inv, scaled))
                if worst.total <= scaled.profile.memory_bytes and node_fits(inv, scaled, worst):
                    return n, batch, layout
        n *= 2
    return None


PART_WORDS = {
    "compute": "compute",
    "tp_ep_comm": "tensor-parallel/expert communication",
    "bubble": "pipeline bubble",
    "dp_comm": "exposed data-parallel communication",
    "pp_comm": "exposed pipeline transfers",
    "cp_comm": "exposed context-parallel communication",
    "overlap": "compute slowed by overlapped communication",
    "optimizer": "optimizer step",
    "offload_copy": "exposed host-link copies",
    "cpu_optimizer": "CPU optimizer step",
}


def why(best: Estimate, runner: Estimate) -> str:
    """Which terms of the step time make the winner faster than the runner-up."""
    gain = runner.step_s / best.step_s - 1
    if gain < 1e-9:
        saved = runner.worst.total - best.worst.total
        if saved > 2**20:
            return f"#1 and #2 have the same estimated step time; #1 needs {saved / 2**30:.2f} GiB less memory per device."
        return (
            "#1 and #2 are equivalent by the estimate (same step time and memory); "
            f"they differ in {_differences(best.layout, runner.layout)}."
        )
    diffs = sorted(((runner.parts[k] - best.parts[k], k) for k in best.parts), reverse=True)
    floor = 0.01 * (runner.step_s - best.step_s)  # ignore terms too small to matter
    wins = [f"{PART_WORDS[k]} {d:.3g} s shorter" for d, k in diffs if d > floor][:2]
    losses = [f"{PART_WORDS[k]} {-d:.3g} s longer" for d, k in reversed(diffs) if d < -floor][:1]
    text = f"#1 is {gain:.2%} faster than #2 ({_differences(best.layout, runner.layout)}): " + ", ".join(wins) + " per step"
    if losses:
        text += f" (against {losses[0]})"
    return text + "."


def _differences(a: Layout, b: Layout) -> str:
    first = dict(x.split("=", 1) for x in a.overrides().split())
    second = dict(x.split("=", 1) for x in b.overrides().split())
    keys = list(first) + [k for k in second if k not in first]
    diff = [f"{k} {first.get(k, '-')} vs {second.get(k, '-')}" for k in keys if first.get(k) != second.get(k)]
    return ", ".join(diff) or "nothing"


def suggestions(shape: Shape, job: Job, *, world: int, smallest: Estimate | None) -> list[str]:
    """What would make a request that fits nowhere possible."""
    out: list[str] = []
    if smallest is not None:
        out.append(_leanest(smallest, world=world))
    found = minimum_devices(shape, job, world=world)
    if found is not None:
        n, batch, layout = found
        node = min(n, job.profile.devices_per_node)
        batch_note = f" train.global_batch_size={batch}" if batch != job.global_batch else ""
        out.append(
            f"More devices: {n} x {job.profile.name} (cluster.nodes={n // node} cluster.devices_per_node={node}) fit it with "
            f"ZeRO-3 and full recompute: {layout.overrides()}{batch_note}. ZeRO-3 shards the 16 bytes per parameter of "
            f"weights, gradients and AdamW moments over the data-parallel ranks; full recompute keeps only each block's input."
        )
    else:
        out.append("More devices alone do not make it fit within 16384 devices: lower model.seq_len or the micro batch.")
    if smallest is not None and not smallest.fits_device:
        bigger = [
            p.name
            for p in known_profiles().values()
            if p.memory_bytes >= smallest.worst.total - job.profile.runtime_reserved_bytes + p.runtime_reserved_bytes
        ]
        if bigger:
            out.append(f"A larger device: the leanest layout would fit on {', '.join(sorted(bigger))}.")
    return out


def _leanest(smallest: Estimate, *, world: int) -> str:
    """What the layout needing the least device memory misses: the device, or its node's host memory."""
    w, name = smallest.worst, smallest.job.profile.name
    head = f"The leanest layout on {world} x {name} ({smallest.layout.overrides()}) needs {gib(w.total)} per device"
    if not smallest.fits_device:
        states = w.weights + w.grads + w.optimizer
        return (
            f"{head}, {gib(-smallest.headroom)} more than it has; "
            f"model states alone are {gib(states)} and activations {gib(w.activations)} at the peak ({w.peak})."
        )
    node = smallest.node
    assert node is not None  # every estimate has its node's host memory
    return (
        f"{head}, which its device holds, but the {node.ranks} ranks of a node need {gib(node.total)} of host memory together, "
        f"{gib(node.total - node.capacity)} over the node's {gib(node.capacity)}."
    )


def search_plan(plan: RunPlan, *, top: int, documents: Documents | None = None) -> SearchResult:
    """Search the cluster of a RunPlan (cluster.nodes x cluster.devices_per_node, cluster.accelerator)."""
    shape, _, job = from_plan(plan, documents=documents)
    c = plan.config.cluster
    world = c.nodes * c.devices_per_node if c.devices_per_node else plan.world_size
    result = search(shape, job, world=world, top=top)
    result.ranked = [e for e in result.ranked if _valid(plan, e.layout)][:top]
    return result


def plan_config(plan: RunPlan, layout: Layout) -> RunConfig:
    """The plan's RunConfig with ``layout`` applied (parallel.* and the micro batch)."""
    c = plan.config
    elastic = c.cluster.min_nodes is not None  # an elastic plan's dp follows the world it gets
    parallel = replace(
        c.parallel,
        dp="auto" if elastic else layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        zero=layout.zero,
        sequence_parallel=layout.sequence_parallel,
        pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages,
        recompute=layout.recompute,
        recompute_every=layout.recompute_every,
        pp_layers=None,
        dp_replicate=layout.dp_replicate,
        offload=layout.offload,
        offload_activations=layout.offload_activations,
        async_tp=layout.async_tp,
    )
    train = replace(c.train, micro_batch_size=layout.micro_batch_size)
    cluster = c.cluster if c.cluster.devices_per_node else replace(c.cluster, devices_per_node=layout.world // c.cluster.nodes)
    return replace(c, parallel=parallel, train=train, cluster=cluster)


def _valid(plan: RunPlan, layout: Layout) -> bool:
    try:
        RunPlan.build(plan_config(plan, layout))
    except UserError:
        return False
    return True
