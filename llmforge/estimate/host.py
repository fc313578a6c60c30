"""What parallelism costs on the host, per call: tensor parallelism's collectives and DTensor calls,
FSDP2's own work, and what every blocking collective waits (no torch).

A tensor-parallel rank runs its sharded linears, embedding, output layer and loss as DTensor
operators. Each call goes through DTensor's dispatch (sharding propagation, wrapping and
unwrapping of the local tensor) before its kernel runs: the profile's ``dtensor_op_us`` per
call, measured by ``llmforge calibrate`` as the extra host time of a DTensor operator over the
plain one. Each collective pays ``comm_latency_us`` per hop (``llmforge.estimate.comm``), which
the calibration fits from its smallest messages. On a CPU rank nothing hides either: the host
is the device.

The counts follow llmforge's eager, fp32, dense GPT as ``llmforge.parallel.tensor`` shards it,
without sequence parallel; ``llmforge.rehearse.counts`` counts a real step, and the tests hold
these numbers to it:

- per microbatch, each sharded linear: ``DTENSOR_OPS_PER_LINEAR`` calls forward and backward,
  ``DTENSOR_OPS_PER_BIAS`` more with a bias; the embedding ``DTENSOR_OPS_FIRST`` (lookup, its
  backward, the tied gradients' sum and accumulation); the output layer and the vocab-parallel
  loss ``DTENSOR_OPS_LAST``;
- per step, the for-loop AdamW of CPU ranks: ``ADAMW_OPS_PER_PARAM`` calls per DTensor
  parameter, one more where weight decay applies;
- collectives per microbatch: four per block (the row-parallel outputs forward, the
  column-parallel inputs' gradients backward; six with full recompute), one for the embedding's
  partial lookups, one for the output layer's input gradient, three for the loss on
  vocab-sharded logits (the maximum, the sum of exponentials, the target logit); per step,
  ``CLIP_COLLECTIVES`` for the gradient norm. Sequence parallel swaps each block's all-reduces
  for an all-gather and a reduce-scatter and gathers once more in backward.

A blocking collective inside a step also waits beyond its back-to-back time: a blocked rank's
threads must be woken (on CPU ranks, and given a core its peer computes on). ``llmforge
calibrate`` over several CPU ranks runs real tensor-parallel steps and fits what they wait as
``comm_sync_us`` per collective (``llmforge.calibrate.tp_wait``). Every collective the host
blocks on pays it: tensor parallelism's, the step's own on any
multi-rank run (``step_collectives``: the gradient clip's norm, the stop vote, the loss's mean
over data-parallel ranks and pipeline stages) and the data-parallel gradient reduction's as CPU
ranks run it (``llmforge.estimate.comm.Traffic.waits``). A pipeline's sends and receives are
not counted: a stage waiting for its neighbour is the schedule's fill and drain, which the
bubble charges. A profile may add by hand ``comm_sync_share`` of the compute and host time
between tensor-parallel collectives, for ranks that drift apart over it (``sync_seconds``). On
a GPU the host queues collectives without waiting for them, and its profile has no
``comm_sync_us``.

Under ZeRO 1-3 a CPU rank also runs FSDP2's own host work: its hooks on every unit each
microbatch, each gather's and reduce-scatter's copies and call, and the for-loop AdamW and clip on
DTensor parameters, at the profile's ``fsdp_unit_us``, ``fsdp_collective_us`` and
``fsdp_param_us`` (``fsdp_host_seconds``; ``llmforge.calibrate.host_probe`` measures them).
"""

from __future__ import annotations

from llmforge.config.choices import Recompute
from llmforge.estimate.params import StageCounts
from llmforge.estimate.shape import Shape
from llmforge.hardware import Profile
from llmforge.layout import Layout

DTENSOR_OPS_PER_LINEAR = 13
DTENSOR_OPS_PER_BIAS = 3
DTENSOR_OPS_FIRST = 4
DTENSOR_OPS_LAST = 20
ADAMW_OPS_PER_PARAM = 7
LOSS_COLLECTIVES = 3
CLIP_COLLECTIVES = 1
#: The training loop's vote, every step, on whether any rank was asked to stop (``llmforge.train.stop``).
STOP_VOTES = 1


def sharded_linears(shape: Shape, *, moe: bool) -> int:
    """Sharded linears of one block: fused q/k/v and o, and (dense MLP) up (or gate/up) and down;
    an MoE layer's MLP is not sharded (``llmforge.parallel.tensor``)."""
    return 2 if moe else 4


def tp_collectives(layout: Layout, *, layers: int, first: bool, last: bool, microbatches: int, per_step: bool = False) -> int:
    """Tensor-parallel collectives of one rank over ``microbatches`` microbatches of ``layers``
    blocks (``first``/``last``: the stage holds the embedding / the output layer and loss);
    ``per_step``: also the gradient clip's, once."""
    if layout.tp == 1:
        return 0
    passes = 6 if layout.recompute == Recompute.FULL else 4
    per_mb = (
        layers * (passes + (1 if layout.sequence_parallel and not layout.async_tp else 0)) + int(first) + (1 + LOSS_COLLECTIVES) * int(last)
    )
    return microbatches * per_mb + (CLIP_COLLECTIVES if per_step else 0)


def dtensor_ops(shape: Shape, layout: Layout, counts: StageCounts, *, microbatches: int) -> int:
    """DTensor operator calls of one rank in one step over ``microbatches`` microbatches of the
    stage ``counts`` describes (``llmforge.estimate.params.StageCounts``), and the optimizer's
    over the rank's DTensor parameters."""
    if layout.tp == 1:
        return 0
    per_linear = DTENSOR_OPS_PER_LINEAR + (DTENSOR_OPS_PER_BIAS if shape.bias else 0)
    dense, moe = counts.dense + counts.dense_ckpt, counts.moe + counts.moe_ckpt
    linears = dense * sharded_linears(shape, moe=False) + moe * sharded_linears(shape, moe=True)
    if layout.recompute == Recompute.FULL:  # the recomputed blocks' forward calls again (about a third of theirs)
        recomputed = counts.dense_ckpt * sharded_linears(shape, moe=False) + counts.moe_ckpt * sharded_linears(shape, moe=True)
        linears_calls = linears * per_linear + recomputed * per_linear // 3
    else:
        linears_calls = linears * per_linear
    per_mb = linears_calls + DTENSOR_OPS_FIRST * int(counts.first) + DTENSOR_OPS_LAST * int(counts.last)
    params = linears * (1 + int(shape.bias))  # weights decay, biases do not
    decayed = linears
    if counts.first:
        params += 1  # the embedding table (no decay)
    if counts.last and not shape.tie_embeddings:
        params, decayed = params + 1, decayed + 1
    return int(microbatches * per_mb + ADAMW_OPS_PER_PARAM * params + decayed)


def dtensor_seconds(shape: Shape, layout: Layout, profile: Profile, counts: StageCounts, *, microbatches: int) -> float:
    """Host seconds of one step's DTensor calls on a tensor-parallel rank (``dtensor_ops``)."""
    return float(dtensor_ops(shape, layout, counts, microbatches=microbatches) * profile.dtensor_op_us * 1e-6)


def step_collectives(layout: Layout) -> int:
    """Blocking collectives every step of a multi-rank run issues besides its parallel dimensions'
    traffic: the gradient clip's norm, the stop vote, and the loss's mean over the data-parallel
    ranks (``llmforge.train.build_step``) or, under a pipeline, over the stages and then over the
    data-parallel ranks (``llmforge.train.pipeline_step``); none on one rank. Tensor parallelism
    counts its clip with its own collectives (``tp_collectives``)."""
    if layout.world == 1:
        return 0
    clip = CLIP_COLLECTIVES if layout.tp == 1 else 0
    data_parallel = layout.dp * layout.cp > 1
    return clip + STOP_VOTES + int(data_parallel) + int(layout.pp > 1)


def fsdp_host_seconds(layout: Layout, profile: Profile, *, blocks: int, microbatches: int, collectives: int, params: int) -> float:
    """Host seconds of FSDP2's own work in one step of a rank holding ``blocks`` blocks and
    ``params`` parameter tensors under ZeRO 1-3: its hooks on every unit (the blocks and the root)
    each microbatch, each of its ``collectives`` gathers and reduce-scatters (the copies into and
    out of the flat buffers, the call), and the for-loop AdamW and clip on DTensor parameters
    (the profile's ``fsdp_unit_us``, ``fsdp_collective_us`` and ``fsdp_param_us``, measured on
    CPU ranks by ``llmforge.calibrate.host_probe``; a GPU's host runs ahead of its kernels)."""
    if layout.zero == 0 or layout.dp * layout.cp == 1:
        return 0.0
    us = profile.fsdp_unit_us * (blocks + 1) * microbatches + profile.fsdp_collective_us * collectives + profile.fsdp_param_us * params
    return us * 1e-6


def sync_seconds(layout: Layout, profile: Profile, *, collectives: int, between_s: float) -> float:
    """What a rank's ``collectives`` blocking collectives wait beyond their back-to-back time:
    the profile's ``comm_sync_us`` each, and on a tensor-parallel rank its ``comm_sync_share`` of
    the ``between_s`` seconds of compute and host work its collectives follow."""
    share = profile.comm_sync_share * between_s if layout.tp > 1 else 0.0
    return collectives * profile.comm_sync_us * 1e-6 + share
