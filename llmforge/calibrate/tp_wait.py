"""What a tensor-parallel step's blocking collectives wait beyond their back-to-back time, from
real tensor-parallel steps (no torch here: ``llmforge.calibrate.tp_step`` runs them).

On CPU ranks a collective inside a step costs more than the same all-reduce timed back to back:
a blocked rank's threads must be woken, and get a core, before the exchange goes on. The
calibration runs two small GPTs' tensor-parallel training steps (``PROBES``) on its ranks, one with
little compute between its collectives and one with several times more, and subtracts what the
estimator counts for each without the waits (kernels, collectives back to back, DTensor calls).
What is left, over the collectives, is the profile's ``comm_sync_us``, a fixed wait per
collective (``llmforge.estimate.host.sync_seconds`` charges it). Over seven GPT shapes on two
ranks, 0.9 to 4.4 ms of compute apart, what each collective waited did not grow with the
compute before it (600-1,100 µs): the ranks do not drift apart enough to matter. A profile
may still set ``comm_sync_share``, a share of the compute between collectives, by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from llmforge.calibrate.fit import TP_STEP
from llmforge.config.schema import ModelConfig
from llmforge.estimate.core import estimate
from llmforge.estimate.host import tp_collectives
from llmforge.estimate.shape import Job, shape_from_config
from llmforge.hardware import Profile
from llmforge.layout import Layout


@dataclass(frozen=True)
class Probe:
    """One small GPT's tensor-parallel training step: ``microbatches`` of ``micro_batch`` sequences,
    the gradient clip and AdamW, as a CPU rank of ``llmforge pretrain`` runs it."""

    model: ModelConfig
    micro_batch: int
    microbatches: int

    def layout(self, tp: int) -> Layout:
        return Layout(tp=tp, micro_batch_size=self.micro_batch)


#: About 1 ms and about 3 ms of a rank's compute and host time between consecutive collectives
#: (four heads: the probes shard over two or four ranks).
PROBES = (
    Probe(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=1024, seq_len=64), 4, 4),
    Probe(ModelConfig(num_layers=2, hidden_size=128, num_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256), 4, 4),
)


@dataclass(frozen=True)
class Expected:
    """What the estimator counts for one probe's step without the waits."""

    seconds: float
    collectives: int
    between_s: float


def expected(probe: Probe, profile: Profile, *, tp: int) -> Expected:
    """The probe's step on ``tp`` ranks of one node as ``profile`` (waits left out) estimates it."""
    quiet = dataclasses.replace(profile, comm_sync_share=0.0, comm_sync_us=0.0)
    batch = probe.micro_batch * probe.microbatches
    job = Job(global_batch=batch, param_dtype="fp32", reduce_dtype="fp32", profile=quiet, devices_per_node=tp)
    layout = probe.layout(tp)
    est = estimate(shape_from_config(probe.model), layout, job)
    count = tp_collectives(layout, layers=probe.model.num_layers, first=True, last=True, microbatches=probe.microbatches, per_step=True)
    return Expected(est.step_s, count, est.parts["compute"] + est.parts["tp_host"])


def fit_wait(rows: Sequence[tuple[Expected, float]]) -> float:
    """Seconds each collective waits: least squares of measured - expected = wait x collectives
    over ``rows`` (each probe's expectation and its measured step seconds), at least 0."""
    points = [(e.collectives, measured - e.seconds) for e, measured in rows]
    squares = sum(n * n for n, _ in points)
    return max(0.0, sum(n * r for n, r in points) / squares) if squares else 0.0


def measured_steps(samples: Sequence) -> list[tuple[Probe, int, float]]:
    """(probe, ranks, seconds) of every timed probe step among the calibration's samples."""
    return [(PROBES[s.nbytes], s.ranks, s.seconds) for s in samples if s.op == TP_STEP]


def wait_keys(samples: Sequence, data: dict, *, profile: Profile) -> dict:
    """``comm_sync_us`` where the calibration timed probe steps (``profile``: the calibrated
    profile without it), and no ``comm_sync_share``."""
    steps = measured_steps(samples)
    if not steps:
        return data
    wait = fit_wait([(expected(probe, profile, tp=ranks), seconds) for probe, ranks, seconds in steps])
    kept = {key: value for key, value in data.items() if key != "comm_sync_share"}
    return {**kept, "comm_sync_us": round(wait * 1e6, 1)}
