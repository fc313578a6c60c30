"""Communication volume per step and the part of it not hidden behind compute.

Ranks are ordered tp (fastest), cp, dp, pp, as Megatron-LM and torchtitan lay
out their meshes, so a group runs over NVLink when it fits inside a node and over
the per-device inter-node link otherwise. Collectives are ring algorithms: an
all-reduce moves 2(n-1)/n of the buffer per rank, an all-gather, a
reduce-scatter and an all-to-all (n-1)/n. Achieved bandwidth is the profile's
peak times its ``comm_efficiency``.

What overlaps (and what the estimate therefore charges to the step):

- data parallel: gradient reduction overlaps the last microbatch's backward
  (bucketed, as DDP and FSDP do); ZeRO-1/2's parameter all-gather after the
  optimizer step is exposed; ZeRO-3 gathers are prefetched behind compute;
- tensor parallel and expert all-to-all sit on the critical path: fully exposed;
- pipeline point-to-point overlaps in steady state; the fill and drain transfers
  (2(p-1) per chunk) are exposed;
- context parallel ring exchange overlaps with the attention it feeds.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.estimate.shape import DTYPE_BYTES, Job, Layout, Shape


@dataclass(frozen=True)
class Comm:
    """Bytes each device sends per step, and seconds of it (total and exposed) per dimension."""

    dp_bytes: float = 0.0
    tp_bytes: float = 0.0
    pp_bytes: float = 0.0
    cp_bytes: float = 0.0
    ep_bytes: float = 0.0
    dp_s: float = 0.0
    tp_s: float = 0.0
    pp_s: float = 0.0
    cp_s: float = 0.0
    ep_s: float = 0.0
    dp_exposed_s: float = 0.0
    pp_exposed_s: float = 0.0
    cp_exposed_s: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.dp_bytes + self.tp_bytes + self.pp_bytes + self.cp_bytes + self.ep_bytes


def _bandwidth(job: Job, span: int) -> float:
    """Achieved per-device bandwidth of a group spanning ``span`` consecutive ranks."""
    prof = job.profile
    bw = prof.intra_node_bandwidth if span <= job.node_size else prof.inter_node_bandwidth
    return bw * prof.comm_efficiency


def dp_bytes(layout: Layout, job: Job, *, dense: int, expert: int, microbatches: int) -> tuple[float, float]:
    """(gradient-reduction bytes, parameter-gather bytes) per device per step."""
    d = layout.dp * layout.cp
    if d == 1:
        return 0.0, 0.0
    de = max(1, d // layout.ep)
    rb, c = DTYPE_BYTES[job.reduce_dtype], job.compute_bytes
    ring = (d - 1) / d
    ring_e = (de - 1) / de
    numel = dense * ring + expert * ring_e
    if layout.zero <= 1:
        grads = 2 * numel * rb
    else:
        grads = numel * rb
    if layout.zero == 3:
        gathers = 2 * microbatches * numel * c
    elif layout.zero in (1, 2):
        gathers = numel * 4  # updated fp32 parameters
    else:
        gathers = 0.0
    return grads, gathers


def tp_bytes(shape: Shape, layout: Layout, job: Job, *, layers: int, microbatches: int) -> float:
    """Per device per step: two collectives per sublayer, forward and backward (and recompute)."""
    t = layout.tp
    if t == 1:
        return 0.0
    tokens = layout.micro_batch * shape.seq / layout.cp
    size = tokens * shape.hidden * job.compute_bytes
    per_layer = (6 if layout.recompute == "full" else 4) * 2 * (t - 1) / t * size
    return microbatches * (layers * per_layer + 2 * (t - 1) / t * size)  # + vocab-parallel embedding


def pp_bytes(shape: Shape, layout: Layout, job: Job, *, microbatches: int) -> tuple[float, float]:
    """(bytes per step, bytes of one transfer) sent between neighbouring stages by one rank."""
    if layout.pp == 1:
        return 0.0, 0.0
    sp = layout.tp if layout.sequence_parallel else 1
    one = layout.micro_batch * shape.seq / layout.cp * shape.hidden * job.compute_bytes / sp
    return 2 * microbatches * layout.virtual_stages * one, one


def cp_bytes(shape: Shape, layout: Layout, job: Job, *, layers: int, microbatches: int) -> float:
    """Ring attention: each rank passes its K and V around (forward), and K, V and their grads (backward)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    tokens = layout.micro_batch * shape.seq / cp
    kv = tokens * 2 * shape.kv_dim / layout.tp * job.compute_bytes
    return microbatches * layers * 3 * (cp - 1) * kv


def ep_bytes(shape: Shape, layout: Layout, job: Job, *, moe_layers: int, microbatches: int) -> float:
    """Dispatch and combine all-to-alls of routed tokens, forward and backward."""
    ep = layout.ep
    if ep == 1 or moe_layers == 0:
        return 0.0
    tokens = layout.micro_batch * shape.seq / layout.cp / (layout.tp if layout.sequence_parallel else 1)
    routed = tokens * shape.top_k * (shape.capacity_factor or 1.0) * shape.hidden * job.compute_bytes
    passes = 6 if layout.recompute == "full" else 4
    return microbatches * moe_layers * passes * (ep - 1) / ep * routed


def spans(layout: Layout) -> dict:
    """Consecutive ranks each group spans (decides NVLink or network)."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return {"tp": tp, "cp": tp * cp, "dp": tp * cp * dp, "ep": tp * cp * layout.ep, "pp": 2 * tp * cp * dp}


def seconds(job: Job, nbytes: float, span: int) -> float:
    return nbytes / _bandwidth(job, span) if nbytes else 0.0
