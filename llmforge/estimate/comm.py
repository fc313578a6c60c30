"""Communication per step by kind, and the part of it not hidden behind compute.

Ranks are ordered tp (fastest), cp, dp, pp, as Megatron-LM and torchtitan lay
out their meshes. A group inside a node runs over NVLink; a group spanning nodes
at the per-device network bandwidth times its members in one node (each GPU has
its own NIC), at most NVLink's (``_bandwidth``). Collectives are ring algorithms:
an all-reduce moves 2(n-1)/n of the buffer per rank, an all-gather, a
reduce-scatter and an all-to-all (n-1)/n. Achieved bandwidth is the profile's
peak times its ``comm_efficiency``. Each collective also pays the profile's
``comm_latency_us`` once per hop (``hops_seconds``): n - 1 for a ring all-gather or
reduce-scatter, 2(n - 1) for a ring all-reduce, 2 log2 n when NCCL's tree is shorter.

What overlaps, as the backend schedules it (each kind a ``Traffic`` with its
exposed part, ``KINDS``):

- data parallel: ZeRO 0's bucketed all-reduce hides behind the last microbatch's
  backward but for its last bucket (``dp_traffic``); FSDP2's gathers and
  reduce-scatters hide block by block behind the blocks' forward and backward
  (``fsdp_traffic``), but for the root's and the first and last blocks';
- tensor parallel and expert all-to-all sit on the critical path: fully exposed, but
  under ``parallel.async_tp`` the collectives torch's micro-pipelining fuses with the
  matmul they feed or follow hide as far as the decomposed matmul lasts
  (``llmforge.estimate.async_tp``);
- pipeline point-to-point overlaps in steady state; the fill and drain transfers
  (2(p-1) per chunk) are exposed;
- context parallel ring exchange overlaps with the attention it feeds.

What hiding costs the compute (FSDP2's copy-out of the gathered units, the SMs a running
collective holds: the profile's ``comm_sm_share`` of the hidden seconds) is charged by
``llmforge.estimate.core``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmforge.config.choices import Dtype, Offload, Recompute
from llmforge.config.dtypes import DTYPE_BYTES
from llmforge.estimate.host import tp_collectives
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout

FP32 = 4


@dataclass(frozen=True)
class Traffic:
    """One kind of communication per device and step: bytes sent, seconds on the link, and the
    seconds the step waits for (exposed); the rest runs under compute (hidden). ``waits``: the
    collectives of this kind a CPU rank's host blocks on (each pays the profile's
    ``comm_sync_us``: ``llmforge.estimate.host``), counted for the data-parallel kinds."""

    bytes: float = 0.0
    seconds: float = 0.0
    exposed: float = 0.0
    waits: int = 0

    @property
    def hidden(self) -> float:
        return self.seconds - self.exposed


#: The kinds ``Comm.kinds`` holds, in report order; ``DIMENSIONS`` maps each to its parallel dimension.
KINDS = ("dp_all_reduce", "dp_all_gather", "dp_reduce_scatter", "tp", "pp", "cp", "ep")
DIMENSIONS = {"dp_all_reduce": "dp", "dp_all_gather": "dp", "dp_reduce_scatter": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep"}


@dataclass(frozen=True)
class Comm:
    """Every kind of communication of the slowest stage (``Traffic`` by kind, see ``KINDS``)."""

    kinds: dict[str, Traffic] = field(default_factory=dict)

    def _sum(self, dim: str, attr: str) -> float:
        total: float = sum(getattr(t, attr) for k, t in self.kinds.items() if DIMENSIONS[k] == dim)
        return total

    def bytes_of(self, dim: str) -> float:
        """Bytes per step of parallel dimension ``dim`` (dp, tp, pp, cp, ep)."""
        return self._sum(dim, "bytes")

    def seconds_of(self, dim: str) -> float:
        return self._sum(dim, "seconds")

    def exposed_of(self, dim: str) -> float:
        return self._sum(dim, "exposed")

    def waits_of(self, dim: str) -> int:
        return int(self._sum(dim, "waits"))


def _bandwidth(job: Job, span: int, group: int) -> float:
    """Achieved per-device bandwidth of a group of ``group`` ranks spanning ``span`` consecutive
    ranks. Across nodes every rank sends through its own network link, so a collective moves
    data as fast as the group's members in one node together can: ``inter_node`` times those
    members (8 for a data-parallel group of whole nodes, 1 when tp fills the node), at most
    the in-node bandwidth (the rings still pass through the node's other GPUs)."""
    prof = job.profile
    if span <= job.node_size:
        return prof.intra_node_bandwidth * prof.comm_efficiency
    members = max(1, min(group, job.node_size * group // span))
    return min(prof.inter_node_bandwidth * members, prof.intra_node_bandwidth) * prof.comm_efficiency


def dp_traffic(
    layout: Layout,
    job: Job,
    *,
    dense: int,
    expert: int,
    microbatches: int,
    blocks: int,
    t_fwd: float,
    t_bwd: float,
    span: int,
    last_bucket: int = 0,
    float8: float = 0.0,
) -> dict[str, Traffic]:
    """Data-parallel traffic per device per step, by kind (``dp_all_reduce``, or FSDP's
    ``dp_all_gather`` and ``dp_reduce_scatter``).

    As llmforge.parallel.data runs it: ZeRO 0 all-reduces gradients in buckets of
    ``parallel.bucket_mb`` launched as the last microbatch's backward produces them, so
    only what exceeds that backward is exposed, and at least the last bucket
    (``last_bucket`` parameters, the embedding's: their gradient is ready when backward
    ends); under a pipeline, or with ``parallel.overlap_grad_reduce`` off, it all-reduces
    after backward (all exposed). ZeRO 1-3 are FSDP2 (``fsdp_traffic``).
    """
    d = layout.dp * layout.cp
    if d == 1:
        return {}
    de = max(1, d // layout.ep)
    rb = DTYPE_BYTES[job.reduce_dtype]
    numel = dense * (d - 1) / d + expert * (de - 1) / de
    if layout.zero > 0:
        share = min(1.0, last_bucket / max(1, dense + expert))
        return fsdp_traffic(
            layout,
            job,
            numel=numel,
            microbatches=microbatches,
            blocks=blocks,
            t_fwd=t_fwd,
            t_bwd=t_bwd,
            span=span,
            tail=share,
            dense=dense,
            float8=float8,
        )
    nbytes = 2 * numel * rb
    buckets = max(1, math.ceil((dense + expert) * rb / max(1, job.bucket_bytes)))
    t = seconds(job, nbytes, span, d) + buckets * hops_seconds(job, all_reduce_hops(d))
    # after backward: one flat all-reduce per reducer (the dense weights', the experts'); overlapped:
    # the wait for the buckets still running when backward ends
    waits = (1 + int(expert > 0)) if job.on_cpu else 0
    if layout.pp > 1 or not numel or not job.overlap_grad_reduce:
        return {"dp_all_reduce": Traffic(nbytes, t, t, waits)}
    tail = min(1.0, max(last_bucket * rb, job.bucket_bytes) * (d - 1) / d / (numel * rb))
    return {"dp_all_reduce": Traffic(nbytes, t, zero0_exposed(t, t_bwd=t_bwd, tail=tail), waits)}


def fsdp_traffic(
    layout: Layout,
    job: Job,
    *,
    numel: float,
    microbatches: int,
    blocks: int,
    t_fwd: float,
    t_bwd: float,
    span: int,
    tail: float,
    dense: float = 0.0,
    float8: float = 0.0,
) -> dict[str, Traffic]:
    """ZeRO 1-3 (FSDP2) per device per step: ``dp_all_gather`` and ``dp_reduce_scatter``.

    One FSDP unit per block plus the root (embedding, final norm, output layer: the
    ``tail`` share of ``numel``). Parameters are all-gathered in the compute dtype;
    gradients are reduce-scattered in the reduce dtype. ZeRO 1 and 2 gather once per
    step (the weights stay gathered through the microbatches); ZeRO 1 reduce-scatters
    once, in the last microbatch's backward, ZeRO 2 in every microbatch's (under a
    pipeline once, as ZeRO 1). ZeRO 3 gathers for every forward and, but for the root
    and the last block (kept gathered), every backward. What overlaps is what FSDP2
    schedules (``llmforge.parallel.data._prefetch``), block by block: in forward block
    i + 1's gather runs during block i's compute; in backward block i - 1's gather and
    block i + 1's reduce-scatter share the link during block i's backward. Exposed: the
    root's and the first block's gathers, what a block's compute cannot cover, and the
    reduce-scatters of block 0 (the last to finish backward) and of the root, which come
    after backward ends.

    ``float8`` of the ``dense`` elements are gathered as float8 (precision.fp8_all_gather).
    On CPU (gloo) FSDP2 calls its collectives synchronously: every gather is exposed, and
    every reduce-scatter unless the backend defers them (``gloo_defers_reduce``).
    HSDP (``layout.dp_replicate`` = R > 1): gathers and reduce-scatters run inside a shard
    group of dp / R consecutive ranks (NVLink when it is a node), and each reduce-scatter
    is followed by an all-reduce of the gradient shard over the R replicas (the network
    when the data-parallel group spans nodes), counted with the reduce-scatter. Every unit's
    gather and reduce-scatter pays the per-hop latency (``hops_seconds``) once.
    """
    m, c, rb = microbatches, job.compute_bytes, DTYPE_BYTES[job.reduce_dtype]
    r = layout.dp_replicate
    group = max(1, layout.dp * layout.cp // r)  # the shard group
    if r > 1:
        numel = dense * (group - 1) / group  # ep = cp = 1 under HSDP
    root = tail * numel  # the root unit is never float8
    gathered = numel * c - float8 * (group - 1) / group * (c - 1)
    allreduce = 2 * (r - 1) / r * dense / group * rb  # the gradient shard, over the replicas
    n = max(1, blocks)
    lat_ag = hops_seconds(job, group - 1)  # one unit's gather; its reduce-scatter also all-reduces over the replicas
    lat_rs = lat_ag + (hops_seconds(job, all_reduce_hops(r)) if r > 1 else 0.0)
    t_rs = seconds(job, numel * rb, span // r, group) + seconds(job, allreduce, span, r)
    root_rs, t_rs = tail * t_rs + lat_rs, t_rs + (n + 1) * lat_rs  # n blocks and the root, each one collective
    t_ag = seconds(job, gathered, span // r, group) + (n + 1) * lat_ag
    root_ag = seconds(job, root * c, span // r, group) + lat_ag
    forward_gathers, backward_gathers, scatters = fsdp_rounds(zero=layout.zero, pp=layout.pp, microbatches=m)
    units = _Units(ag=(t_ag - root_ag) / n, rs=(t_rs - root_rs) / n, f=t_fwd / n, b=t_bwd / n, n=n)
    alone = fsdp_exposed_units(layout, blocks=n)
    whole = {"root": (root_ag, root_rs), "first block": (units.ag, units.rs)}  # the units no compute window covers
    ag_exposed = forward_gathers * (sum(whole[u][0] for u in alone["dp_all_gather"]) + units.forward())
    both_ag, both_rs = units.backward(gather=True, scatter=True)
    alone_ag, _ = units.backward(gather=True, scatter=False)
    _, alone_rs = units.backward(gather=False, scatter=True)
    together = min(scatters, backward_gathers)  # microbatches whose backward gathers and reduce-scatters
    ag_exposed += together * both_ag + (backward_gathers - together) * alone_ag
    rs_exposed = together * both_rs + (scatters - together) * alone_rs + scatters * sum(whole[u][1] for u in alone["dp_reduce_scatter"])
    gathers_s = forward_gathers * t_ag + backward_gathers * units.ag * (n - 1)
    block_bytes = (gathered - root * c) / n
    gathers_b = forward_gathers * gathered + backward_gathers * block_bytes * (n - 1)
    gather_waits = scatter_waits = 0
    if job.on_cpu:  # gloo: FSDP2 waits on the host for every gather, and every reduce-scatter it does not defer (those once)
        deferred = gloo_defers_reduce(layout, job)
        ag_exposed = gathers_s
        rs_exposed = rs_exposed if deferred else scatters * t_rs
        gather_waits, scatter_waits = fsdp_collectives(zero=layout.zero, pp=layout.pp, blocks=n, microbatches=m)
        scatter_waits = 1 if deferred else scatter_waits
    return {
        "dp_all_gather": Traffic(gathers_b, gathers_s, ag_exposed, gather_waits),
        "dp_reduce_scatter": Traffic(scatters * (numel * rb + allreduce), scatters * t_rs, rs_exposed, scatter_waits),
    }


def fsdp_rounds(*, zero: int, pp: int, microbatches: int) -> tuple[int, int, int]:
    """(forward gathers, backward gathers, reduce-scatters) of each FSDP2 unit per step: ZeRO 1
    and 2 gather once, ZeRO 3 in every microbatch's forward and backward; ZeRO 1 (and any stage
    under a pipeline) reduce-scatters once, ZeRO 2 and 3 in every microbatch."""
    m = microbatches
    scatters = m if zero >= 2 and pp == 1 else 1
    return (m if zero == 3 else 1), (m if zero == 3 else 0), scatters


def fsdp_collectives(*, zero: int, pp: int, blocks: int, microbatches: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of one step over ``blocks`` FSDP2 block units and the root:
    backward gathers neither the root nor the last block, which stay gathered after forward."""
    forward, backward, scatters = fsdp_rounds(zero=zero, pp=pp, microbatches=microbatches)
    n = max(1, blocks)
    return forward * (n + 1) + backward * (n - 1), scatters * (n + 1)


def gloo_defers_reduce(layout: Layout, job: Job) -> bool:
    """Whether the backend launches FSDP2's reduce-scatters without waiting on gloo
    (``llmforge.parallel.data.can_defer_reduce``): ZeRO 1, fp32 reduction,
    ``parallel.overlap_grad_reduce``, no pipeline, no HSDP, no offload, no expert units."""
    return (
        layout.zero == 1
        and job.reduce_dtype == Dtype.FP32
        and job.overlap_grad_reduce
        and layout.pp == 1
        and layout.dp_replicate == 1
        and layout.offload == Offload.NONE
        and layout.ep == 1
    )


def fsdp_exposed_units(layout: Layout, *, blocks: int) -> dict[str, tuple[str, ...]]:
    """The FSDP2 collectives of a step that no compute window covers, by kind, as
    ``llmforge.parallel.data`` schedules them (their whole time is exposed; every other
    unit's is hidden as far as the compute it overlaps lasts). Gathers: the root's (its
    forward needs it first) and the first block's, which the root prefetches before the
    embedding (no matmul runs before the first block's forward). Reduce-scatters: the first
    block's and the root's, issued when their backward ends, with no block's backward
    after them. ``tests/test_zero_overlap.py`` holds this to a profiler trace."""
    if layout.zero == 0 or layout.dp * layout.cp == 1:
        return {}
    ends = ("root", "first block") if blocks else ("root",)
    return {"dp_all_gather": ends, "dp_reduce_scatter": tuple(reversed(ends))}


@dataclass(frozen=True)
class _Units:
    """Per block: gather and reduce-scatter seconds, forward and backward compute, and the block count."""

    ag: float
    rs: float
    f: float
    b: float
    n: int

    def forward(self) -> float:
        """Exposed gather seconds of one forward's later blocks: what each block's gather
        (prefetched during the block before) exceeds that block's compute (the first block's
        has no window: ``fsdp_exposed_units``)."""
        return (self.n - 1) * max(0.0, self.ag - self.f)

    def backward(self, *, gather: bool, scatter: bool) -> tuple[float, float]:
        """(gather, reduce-scatter) seconds one backward's block windows cannot hide: the
        last block's backward covers the gather of the block before it, each middle block's
        that gather and the reduce-scatter of the block after it, the first block's that
        reduce-scatter (the first block's own comes after backward: charged by the caller)."""
        ag, rs = self.ag if gather else 0.0, self.rs if scatter else 0.0
        if self.n < 2:
            return 0.0, 0.0
        windows = ((ag, 0.0, 1), (ag, rs, self.n - 2), (0.0, rs, 1))
        out_ag = out_rs = 0.0
        for a, s, count in windows:
            over = max(0.0, a + s - self.b)
            if over and count:
                out_ag, out_rs = out_ag + count * over * a / (a + s), out_rs + count * over * s / (a + s)
        return out_ag, out_rs


def zero0_exposed(t_allreduce: float, *, t_bwd: float, tail: float) -> float:
    """Exposed seconds of ZeRO 0's overlapped all-reduce (``t_allreduce`` in all):
    what the last microbatch's backward (``t_bwd``) cannot hide, and never less than
    the ``tail`` share (the last bucket, launched when backward ends)."""
    return max(t_allreduce - t_bwd, tail * t_allreduce)


def tp_bytes(shape: Shape, layout: Layout, job: Job, *, layers: int, microbatches: int) -> float:
    """Per device per step: two collectives per sublayer, forward and backward (and
    recompute); with sequence parallel one more in backward, the gather of the
    sequence shard the column-parallel linears kept (``llmforge.parallel.sequence``), but
    under async TP (torch's styles: the linears keep the gathered input)."""
    t = layout.tp
    if t == 1:
        return 0.0
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    size = tokens * shape.hidden * job.compute_bytes
    per_layer = (6 if layout.recompute == Recompute.FULL else 4) * 2 * (t - 1) / t * size
    if layout.sequence_parallel and not layout.async_tp:  # async TP's linears keep the gathered input
        per_layer += 2 * (t - 1) / t * size
    return microbatches * (layers * per_layer + 2 * (t - 1) / t * size)  # + vocab-parallel embedding


def critical_latency(
    shape: Shape, layout: Layout, job: Job, *, layers: int, moe_layers: int, microbatches: int, first: bool = True, last: bool = True
) -> dict[str, float]:
    """The fixed part (``hops_seconds``) of the collectives on the critical path, per step: ``tp``
    (each collective ``llmforge.estimate.host.tp_collectives`` counts: the blocks' all-reduces, or
    with sequence parallel all-gathers and reduce-scatters of n - 1 hops, the embedding's, the
    output layer's and the vocab-parallel loss's on the ``first`` and ``last`` stage) and ``ep``
    (two all-to-alls per MoE layer and pass)."""
    t, e = layout.tp, layout.ep
    passes = 6 if layout.recompute == Recompute.FULL else 4
    out = {"tp": 0.0, "ep": 0.0}
    if t > 1:
        hops = t - 1 if layout.sequence_parallel else all_reduce_hops(t)
        count = tp_collectives(layout, layers=layers, first=first, last=last, microbatches=microbatches)
        out["tp"] = count * hops_seconds(job, hops)
    if e > 1 and moe_layers:
        out["ep"] = microbatches * moe_layers * passes * hops_seconds(job, e - 1)
    return out


def pp_bytes(shape: Shape, layout: Layout, job: Job, *, microbatches: int) -> tuple[float, float]:
    """(bytes per step, bytes of one transfer) sent between neighbouring stages by one rank."""
    if layout.pp == 1:
        return 0.0, 0.0
    sp = layout.tp if layout.sequence_parallel else 1
    one = layout.micro_batch_size * shape.seq / layout.cp * shape.hidden * job.residual_bytes / sp  # the residual stream
    return 2 * microbatches * layout.pp_virtual_stages * one, one


def cp_bytes(shape: Shape, layout: Layout, job: Job, *, layers: int, microbatches: int) -> float:
    """Ring attention: each rank passes its K and V around (forward), and K, V and their grads (backward)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    tokens = layout.micro_batch_size * shape.seq / cp
    kv = tokens * 2 * shape.kv_dim / layout.tp * job.compute_bytes
    return microbatches * layers * 3 * (cp - 1) * kv


def ep_bytes(shape: Shape, layout: Layout, job: Job, *, moe_layers: int, microbatches: int) -> float:
    """Dispatch and combine all-to-alls of routed tokens, forward and backward."""
    ep = layout.ep
    if ep == 1 or moe_layers == 0:
        return 0.0
    tokens = layout.micro_batch_size * shape.seq / layout.cp / (layout.tp if layout.sequence_parallel else 1)
    routed = tokens * shape.top_k * (shape.capacity_factor or 1.0) * shape.hidden * job.compute_bytes
    passes = 6 if layout.recompute == Recompute.FULL else 4
    return microbatches * moe_layers * passes * (ep - 1) / ep * routed


def spans(layout: Layout) -> dict[str, int]:
    """Consecutive ranks each group spans (decides NVLink or network)."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return {"tp": tp, "cp": tp * cp, "dp": tp * cp * dp, "ep": tp * cp * layout.ep, "pp": 2 * tp * cp * dp}


def groups(layout: Layout) -> dict[str, int]:
    """Ranks in each group (with ``spans``: how many of them share a node)."""
    return {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp * layout.cp, "ep": layout.ep, "pp": 2}


def all_reduce_hops(n: int) -> int:
    """Latency hops of one all-reduce over ``n`` ranks: a ring's 2(n - 1), or NCCL's tree
    (2 log2 n: up and down) where that is shorter."""
    return min(2 * (n - 1), 2 * math.ceil(math.log2(n))) if n > 1 else 0


def hops_seconds(job: Job, hops: float) -> float:
    """The fixed part of a collective that passes ``hops`` steps (``comm_latency_us`` each)."""
    return max(0.0, hops) * job.profile.comm_latency_us * 1e-6


def seconds(job: Job, nbytes: float, span: int, group: int = 1) -> float:
    """Time to move ``nbytes`` per device in a group of ``group`` ranks spanning ``span`` ranks."""
    return nbytes / _bandwidth(job, span, group) if nbytes else 0.0
