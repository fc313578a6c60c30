"""What a tensor-parallel step's blocking collectives wait beyond their back-to-back time, from
real tensor-parallel steps (no torch here: ``llmforge.calibrate.tp_step`` runs them).

On CPU ranks a collective inside a step costs more than the same all-reduce timed back to back:
the ranks drift apart over the compute before it, and a blocked rank's threads must be woken,
and get a core, before the exchange goes on. The calibration runs two small GPTs' tensor-parallel
training steps (``PROBES``) on its ranks, one with little compute between its collectives and one
with several times more, and subtracts what the estimator counts for each without the waits
(kernels, collectives back to back, DTensor calls). What is left is fitted as a fixed wait per
collective (the profile's ``comm_sync_us``) plus a share of the compute and host time the
collectives follow (``comm_sync_share``); ``llmforge.estimate.host.sync_seconds`` charges both.
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


@dataclass(frozen=True)
class Waits:
    """A tensor-parallel collective's wait: ``per_call_s`` each, plus ``share`` of the compute before it."""

    per_call_s: float
    share: float


def fit_waits(rows: Sequence[tuple[Expected, float]]) -> Waits:
    """Least squares of measured - expected = per_call x collectives + share x between, neither
    negative (``rows``: each probe's expectation and its measured step seconds)."""
    points = [(e.collectives, e.between_s, max(0.0, measured - e.seconds)) for e, measured in rows]
    both = _solve(points)
    if both is not None and both.per_call_s >= 0 and both.share >= 0:
        return both
    per_call = Waits(_through_origin([(n, r) for n, _, r in points]), 0.0)
    share = Waits(0.0, _through_origin([(b, r) for _, b, r in points]))
    return min((per_call, share), key=lambda w: _squared_error(w, points))


def _solve(points: Sequence[tuple[float, float, float]]) -> Waits | None:
    """The unconstrained two-term fit (None where the probes cannot tell the terms apart)."""
    nn = sum(n * n for n, _, _ in points)
    nb = sum(n * b for n, b, _ in points)
    bb = sum(b * b for _, b, _ in points)
    nr = sum(n * r for n, _, r in points)
    br = sum(b * r for _, b, r in points)
    det = nn * bb - nb * nb
    if det <= 1e-12 * nn * bb:
        return None
    return Waits((nr * bb - br * nb) / det, (br * nn - nr * nb) / det)


def _through_origin(points: Sequence[tuple[float, float]]) -> float:
    xx = sum(x * x for x, _ in points)
    return sum(x * y for x, y in points) / xx if xx > 0 else 0.0


def _squared_error(waits: Waits, points: Sequence[tuple[float, float, float]]) -> float:
    return sum((waits.per_call_s * n + waits.share * b - r) ** 2 for n, b, r in points)


def measured_steps(samples: Sequence) -> list[tuple[Probe, int, float]]:
    """(probe, ranks, seconds) of every timed probe step among the calibration's samples."""
    return [(PROBES[s.nbytes], s.ranks, s.seconds) for s in samples if s.op == TP_STEP]


def wait_keys(samples: Sequence, data: dict, *, profile: Profile) -> dict:
    """``comm_sync_us`` and ``comm_sync_share`` where the calibration timed probe steps
    (``profile``: the calibrated profile without them)."""
    steps = measured_steps(samples)
    if not steps:
        return data
    waits = fit_waits([(expected(probe, profile, tp=ranks), seconds) for probe, ranks, seconds in steps])
    return {**data, "comm_sync_us": round(waits.per_call_s * 1e6, 1), "comm_sync_share": round(waits.share, 3)}
