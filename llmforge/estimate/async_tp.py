"""What ``parallel.async_tp`` (torch's micro-pipelined tensor parallel) hides, and what it costs.

Under ``torch.compile`` Inductor's ``micro_pipeline_tp_pass`` (``torch/_inductor/fx_passes/
micro_pipeline_tp.py``) rewrites two patterns of a compiled graph, and only these:

- an all-gather whose result is the left operand of matmuls (``fused_all_gather_matmul``);
- a reduce-scatter whose input is one matmul's output with no other user
  (``fused_matmul_reduce_scatter``).

A sublayer under sequence parallel offers four such pairs (``PAIRS``): forward, the gather
into the column-parallel projection and the row-parallel projection's reduce-scatter; backward,
the gather of the output gradient into the row-parallel input-gradient matmul and the
column-parallel input gradient's reduce-scatter. Full recompute repeats the forward pair.
Which of them the pass finds depends on the graph (``backend_pairs``): a reduce-scatter of a
sum of matmuls (q, k, v or gate, up as separate linears) is left alone, and so is a gather
whose result is cast to float8 before its matmul. Every other collective (the embedding's, the
loss's, the output layer's) stays on the critical path.

The fused op (``torch/distributed/_symmetric_memory``) splits the matmul along the tokens into
``tp`` chunks: the gather's shards are copied from the peers' symmetric-memory buffers while
the chunks already there are multiplied; for the reduce-scatter each chunk's partial output is
computed, copied to the peer that owns it, and the ``tp`` partials are summed by a separate
kernel. So, per pair (``pair_cost``):

- hidden: min(collective, (tp - 1) / tp x the chunked matmul), the first (gather) or last
  (reduce-scatter) chunk having no transfer to overlap;
- the chunked matmuls, ``tp`` of ``tokens / tp`` rows each, are slower than one whole one
  (the kernel model's shape term: ``Speeds.gemm``);
- the reduce-scatter's sum reads every partial and writes the shard (memory-bound), work
  NCCL's reduce-scatter did inside the collective; the gather first copies the local shard
  into its symmetric buffer (memory-bound, before the first barrier).

The copies are ``copy_`` between peers' mapped buffers, run by the copy engines: they hold no
SMs, so the step does not charge ``comm_sm_share`` on what async TP hides (``core``).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.choices import Activation, Recompute
from llmforge.estimate import comm as cm
from llmforge.estimate import kernels as kn
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout

#: The collective-matmul pairs of a tensor-parallel sublayer that the pass can fuse.
PAIRS = ("forward_gather", "forward_scatter", "backward_gather", "backward_scatter")


@dataclass(frozen=True)
class AsyncTP:
    """Per microbatch: TP collective seconds hidden under the decomposed matmuls, and the
    compute the decomposition adds (slower chunked matmuls, the partials' sum, the shard copies)."""

    hidden: float = 0.0
    cost: kn.Cost = kn.NONE


NONE = AsyncTP()


def backend_pairs(job: Job) -> frozenset[str]:
    """The pairs llmforge's blocks give the pass in a form it fuses. q/k/v and gate/up are one
    linear each (``llmforge.models.layers``), so each column-parallel input gradient is one
    matmul: both reduce-scatters fuse. Under float8 (torchao's ``Float8Linear`` under torch's
    styles) the gathered input and the gathered output gradient are cast to float8 before their
    ``_scaled_mm``: the gathers' consumers are the casts, and neither gather fuses."""
    if job.fp8:
        return frozenset({"forward_scatter", "backward_scatter"})
    return frozenset(PAIRS)


def _windows(shape: Shape, *, t: int, forward: int) -> list[tuple[str, bool, int, bool, float, float]]:
    """(pair, in attention, runs per microbatch, a gather, k, n) of one block's candidate pairs: a
    column-parallel projection (q/k/v, gate/up: ``[tokens x hidden] @ [hidden x width / t]``) is
    gathered into forward and its input gradient (``[tokens x width / t] @ [width / t x hidden]``)
    reduce-scattered; a row-parallel one (o, down) the other way round. ``forward``: 2 under full
    recompute, which runs the forward pairs again."""
    q = shape.heads * shape.head_dim
    up = (2 if shape.activation == Activation.SWIGLU else 1) * shape.ffn
    h, out = shape.hidden, []
    for attention, column, row in ((True, q + 2 * shape.kv_dim, q), (False, up, shape.ffn)):
        c, r = column / t, row / t
        out += [
            ("forward_gather", attention, forward, True, h, c),
            ("backward_scatter", attention, 1, False, c, h),
            ("forward_scatter", attention, forward, False, r, h),
            ("backward_gather", attention, 1, True, h, r),
        ]
    return out


def pair_cost(sp: kn.Speeds, *, gather: bool, m: float, k: float, n: float, tp: int, collective: float, c: int, scale: float) -> AsyncTP:
    """One fused pair: the matmul ``[m x k] @ [k x n]`` (``scale``: its rate against the
    16-bit peak) and its all-gather (``gather``) or reduce-scatter of ``collective`` seconds."""
    whole = sp.gemm(m, k, n).times(scale)
    chunked = sp.gemm(m / tp, k, n, count=tp).times(scale)
    hidden = min(collective, (tp - 1) / tp * chunked.seconds)
    if gather:  # the local shard into the symmetric buffer: read and written once
        extra = sp.memory(2 * m / tp * k * c, kernels=1)
    else:  # the tp partials summed into the shard: read tp partials of m / tp rows, write one
        extra = sp.memory(m * n * c + m / tp * n * c, kernels=1)
    added = kn.Cost(matmul=chunked.matmul - whole.matmul, floor=chunked.floor - whole.floor)
    return AsyncTP(hidden=hidden, cost=added.plus(extra))


def async_tp(
    shape: Shape,
    layout: Layout,
    job: Job,
    *,
    attention_layers: int,
    mlp_layers: int,
    pairs: frozenset[str] | None = None,
) -> AsyncTP:
    """One microbatch's hidden TP seconds and added compute under ``parallel.async_tp`` (nothing
    without it). ``pairs``: the pairs the pass fuses (``backend_pairs`` unless given). MoE MLPs
    are not tensor-parallel (``mlp_layers`` counts the dense ones)."""
    t = layout.tp
    if not (layout.async_tp and layout.sequence_parallel and t > 1):
        return NONE
    pairs = backend_pairs(job) if pairs is None else pairs
    sp, c = kn.speeds(job), job.compute_bytes
    tokens = layout.micro_batch_size * shape.seq / layout.cp
    one = cm.seconds(job, (t - 1) / t * tokens * shape.hidden * c, cm.spans(layout)["tp"], t)
    scale = job.profile.peak(job.param_dtype) / job.profile.peak("fp8") if job.fp8 and job.profile.has_fp8 else 1.0
    forward = 2 if layout.recompute == Recompute.FULL else 1
    hidden, cost = 0.0, kn.NONE
    for name, attention, runs, gather, k, n in _windows(shape, t=t, forward=forward):
        count = runs * (attention_layers if attention else mlp_layers)
        if name in pairs and count:
            pair = pair_cost(sp, gather=gather, m=tokens, k=k, n=n, tp=t, collective=one, c=c, scale=scale)
            hidden, cost = hidden + count * pair.hidden, cost.plus(pair.cost.times(count))
    return AsyncTP(hidden=hidden, cost=cost)
