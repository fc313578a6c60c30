"""Communication volume per step and the part of it not hidden behind compute.

Ranks are ordered tp (fastest), cp, dp, pp, as Megatron-LM and torchtitan lay
out their meshes, so a group runs over NVLink when it fits inside a node and over
the per-device inter-node link otherwise. Collectives are ring algorithms: an
all-reduce moves 2(n-1)/n of the buffer per rank, an all-gather, a
reduce-scatter and an all-to-all (n-1)/n. Achieved bandwidth is the profile's
peak times its ``comm_efficiency``.

What overlaps (and what the estimate therefore charges to the step):

- data parallel: see ``dp_traffic`` (ZeRO 0's bucketed all-reduce hides behind the
  last microbatch's backward but for its last bucket, and is exposed under a
  pipeline or with ``parallel.overlap_grad_reduce`` off; FSDP's compute-dtype
  gathers and reduce-scatters hide behind a microbatch's forward or backward but
  for the root unit's, see ``fsdp_traffic``);
- tensor parallel and expert all-to-all sit on the critical path: fully exposed;
- pipeline point-to-point overlaps in steady state; the fill and drain transfers
  (2(p-1) per chunk) are exposed;
- context parallel ring exchange overlaps with the attention it feeds.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.dtypes import DTYPE_BYTES
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout

FP32 = 4
# llmforge.parallel.data.BUCKET_BYTES: ZeRO 0's gradient bucket cap
BUCKET_BYTES = 25 * 2**20


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


def dp_traffic(layout: Layout, job: Job, *, dense: int, expert: int, microbatches: int,
               t_fwd: float, t_bwd: float, span: int, last_bucket: int = 0, float8: float = 0.0) -> tuple[float, float, float]:
    """(bytes, seconds, exposed seconds) of data-parallel traffic per device per step.

    As llmforge.parallel.data runs it: ZeRO 0 all-reduces gradients in buckets
    launched as the last microbatch's backward produces them, so only what exceeds
    that backward is exposed, and at least the last bucket (``last_bucket``
    parameters, the embedding's: their gradient is ready when backward ends);
    under a pipeline the schedule runs backward and ZeRO 0 all-reduces afterwards
    (all exposed). ZeRO 1-3 are FSDP2 (``fsdp_traffic``).
    """
    d = layout.dp * layout.cp
    if d == 1:
        return 0.0, 0.0, 0.0
    de = max(1, d // layout.ep)
    rb = DTYPE_BYTES[job.reduce_dtype]
    numel = dense * (d - 1) / d + expert * (de - 1) / de
    if layout.zero > 0:
        share = min(1.0, last_bucket / max(1, dense + expert))
        return fsdp_traffic(layout, job, numel=numel, microbatches=microbatches, t_fwd=t_fwd, t_bwd=t_bwd, span=span, tail=share,
                            dense=dense, float8=float8)
    nbytes = 2 * numel * rb
    t = seconds(job, nbytes, span)
    if layout.pp > 1 or not numel or not job.overlap_grad_reduce:
        return nbytes, t, t
    tail = min(1.0, max(last_bucket * rb, BUCKET_BYTES) * (d - 1) / d / (numel * rb))
    return nbytes, t, zero0_exposed(t, t_bwd=t_bwd, tail=tail)


def fsdp_traffic(layout: Layout, job: Job, *, numel: float, microbatches: int, t_fwd: float, t_bwd: float,
                 span: int, tail: float, dense: float = 0.0, float8: float = 0.0) -> tuple[float, float, float]:
    """(bytes, seconds, exposed seconds) of ZeRO 1-3 (FSDP2) per device per step.

    Parameters are all-gathered in the compute dtype, block by block, each block
    prefetching the next; gradients are reduce-scattered in the reduce dtype as
    backward finishes each block. ZeRO 1 and 2 gather once per step (the weights
    stay gathered through the microbatches); ZeRO 1 reduce-scatters once, during
    the last microbatch's backward, ZeRO 2 during every microbatch's. ZeRO 3
    gathers for every forward and backward. Under a pipeline the schedule keeps
    weights and gradients until the stage's last microbatch (ZeRO 1 and 2 alike).
    Hidden: what a microbatch's forward (gathers) or backward (reduce-scatters,
    ZeRO 3's backward gathers) covers, never the ``tail`` share: the root unit
    (embedding, output layer) is gathered before the first block computes and
    its gradients are reduced after the last.

    ``float8`` of the ``dense`` elements are gathered as float8 (precision.fp8_all_gather).
    HSDP (``layout.dp_replicate`` = R > 1): gathers and reduce-scatters run inside a shard
    group of dp / R consecutive ranks (NVLink when it is a node), and each reduce-scatter
    is followed by an all-reduce of the gradient shard over the R replicas (the network
    when the data-parallel group spans nodes), hidden behind backward as it is.
    """
    m, c, rb = microbatches, job.compute_bytes, DTYPE_BYTES[job.reduce_dtype]
    r = layout.dp_replicate
    group = max(1, layout.dp * layout.cp // r)  # the shard group
    if r > 1:
        numel = dense * (group - 1) / group  # ep = cp = 1 under HSDP
    gathered = numel * c - float8 * (group - 1) / group * (c - 1)
    allreduce = 2 * (r - 1) / r * dense / group * rb  # the gradient shard, over the replicas
    t_rs = seconds(job, numel * rb, span // r) + seconds(job, allreduce, span)
    t_ag = seconds(job, gathered, span // r)
    scatters = m if layout.zero >= 2 and layout.pp == 1 else 1
    forward_gathers = m if layout.zero == 3 else 1
    backward_gathers = m if layout.zero == 3 else 0
    exposed = scatters * max(t_rs - t_bwd, tail * t_rs) + forward_gathers * max(t_ag - t_fwd, tail * t_ag)
    exposed += backward_gathers * max(0.0, t_ag - t_bwd)
    nbytes = scatters * (numel * rb + allreduce) + (forward_gathers + backward_gathers) * gathered
    return nbytes, scatters * t_rs + (forward_gathers + backward_gathers) * t_ag, exposed


def zero0_exposed(t_allreduce: float, *, t_bwd: float, tail: float) -> float:
    """Exposed seconds of ZeRO 0's overlapped all-reduce (``t_allreduce`` in all):
    what the last microbatch's backward (``t_bwd``) cannot hide, and never less than
    the ``tail`` share (the last bucket, launched when backward ends)."""
    return max(t_allreduce - t_bwd, tail * t_allreduce)


def tp_bytes(shape: Shape, layout: Layout, job: Job, *, layers: int, microbatches: int) -> float:
    """Per device per step: two collectives per sublayer, forward and backward (and
    recompute); with sequence parallel one more in backward, the gather of the
    sequence shard the column-parallel linears kept (``llmforge.parallel.sequence``)."""
    t = layout.tp
    if t == 1:
        return 0.0
    tokens = layout.micro_batch * shape.seq / layout.cp
    size = tokens * shape.hidden * job.compute_bytes
    per_layer = (6 if layout.recompute == "full" else 4) * 2 * (t - 1) / t * size
    if layout.sequence_parallel:
        per_layer += 2 * (t - 1) / t * size
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
    """Time to move ``nbytes`` per device in a group spanning ``span`` ranks."""
    return nbytes / _bandwidth(job, span) if nbytes else 0.0
