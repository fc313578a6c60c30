"""Whether a calibration's figures can be trusted (no torch).

A calibration runs its whole grid of timings several times, each pass in the opposite
order to the one before (interleaved: a burst of load hits different shapes in each),
takes the median of the passes for every timing (``combine``), and then asks two
questions (``judge``): do the passes agree (each fitted on its own, at the ``matmul_dim``
of the medians: the reference matmul rate, attention and memory-bound rates), and did
other processes take a share of the CPUs it measured on. A calibration that fails either
is retried, and where it still fails, flagged in its profile and said so
(``llmforge.calibrate.run.measure_trusted``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmforge.calibrate.fit import ComputeSamples, Fitted, fit_compute, median

#: Passes over the grid (the median of three outlives one disturbed pass).
PASSES = 3
#: Passes whose fitted rates differ by more than this (max / min - 1) disagree.
MAX_SPREAD = 0.25
#: Other processes taking more than this share of the calibration's threads make it untrusted.
MAX_CONTENTION = 0.15


@dataclass(frozen=True)
class Verdict:
    """``trusted``, else the reasons, each a phrase (``spread``: the passes' worst disagreement;
    ``others_cores``: the most CPUs' worth of other processes' work during one pass)."""

    reasons: list[str] = field(default_factory=list)
    spread: float = 0.0
    others_cores: float | None = None

    @property
    def trusted(self) -> bool:
        return not self.reasons

    def provenance(self) -> dict:
        """The ``calibration`` keys that record it."""
        out = {"trusted": self.trusted, "repeat_spread": round(self.spread, 3)}
        if self.others_cores is not None:
            out["other_processes_cpus"] = round(self.others_cores, 2)
        if self.reasons:
            out["untrusted_because"] = "; ".join(self.reasons)
        return out


def _median_of(values: Sequence[float]) -> float:
    return float(median(list(values)))


def _combine_list(items: Sequence[list]) -> list:
    """Element-wise median of the timing fields of each position's samples across passes."""
    out = []
    for same in zip(*items, strict=False):
        first = same[0]
        timed = {
            f.name: _median_of([getattr(s, f.name) for s in same])
            for f in dataclasses.fields(first)
            if f.name.endswith("seconds") or f.name.endswith("_s")
        }
        out.append(dataclasses.replace(first, **timed))
    return out


def combine(passes: Sequence[ComputeSamples]) -> ComputeSamples:
    """One set of samples: each timing the median of the passes' (each pass measured the same
    grid); the passes and load readings are kept on it for ``judge``."""
    first = passes[0]
    return dataclasses.replace(
        first,
        floor_s=_median_of([p.floor_s for p in passes]),
        step_floor_s=_median_of([p.step_floor_s for p in passes]),
        matmul={d: _combine_list([p.matmul[d] for p in passes]) for d in first.matmul},
        attention={d: _combine_list([p.attention[d] for p in passes]) for d in first.attention},
        bandwidth=_combine_list([p.bandwidth for p in passes]),
        host_copies=_combine_list([p.host_copies for p in passes]),
        passes=list(passes),
        load=[r for p in passes for r in p.load],
    )


def _rates(f: Fitted) -> dict:
    out = {f"{f.reference_dtype} matmul": f.rates[f.reference_dtype], "memory-bound": f.bandwidth}
    if f.attention_flops:
        out["attention"] = f.attention_flops
    return out


def spread(passes: Sequence[ComputeSamples], *, matmul_dim: float | None = None) -> tuple[float, str]:
    """(worst max / min - 1 over the passes' fitted rates, the rate it was). Every pass is fitted
    with one ``matmul_dim`` (by default the one of their medians): fitted on its own, each pass
    could pick another (a flat optimum that a few percent of noise moves from 0 to 512), and
    the matmul and attention rates, which are read at that ``matmul_dim``, would then differ by
    several times on a quiet machine."""
    dim = fit_compute(combine(passes)).matmul_dim if matmul_dim is None else matmul_dim
    fits = [_rates(fit_compute(p, dims=(dim,))) for p in passes]
    worst = (0.0, "")
    for key in fits[0]:
        values = [f[key] for f in fits if f.get(key)]
        if len(values) > 1 and min(values) > 0:
            worst = max(worst, (max(values) / min(values) - 1, key))
    return worst


def judge(samples: ComputeSamples, *, max_spread: float = MAX_SPREAD, max_contention: float = MAX_CONTENTION) -> Verdict:
    """Trusted, or why not: passes that disagree, or other processes on the calibration's CPUs
    (on a CPU device; a GPU's timings do not share its CPUs' load)."""
    reasons = []
    worst, key = spread(samples.passes, matmul_dim=fit_compute(samples).matmul_dim) if len(samples.passes) > 1 else (0.0, "")
    if worst > max_spread:
        reasons.append(f"its {len(samples.passes)} passes disagree: the {key} rate varied by {worst:.0%}")
    others = max((r.others_cores for r in samples.load), default=None)
    if samples.device == "cpu" and samples.load:
        busiest = max(samples.load, key=lambda r: r.contention)
        if busiest.contention > max_contention:
            reasons.append(
                f"other processes kept {busiest.others_cores:.1f} of the {busiest.cpus} CPUs it measured "
                f"{busiest.threads} thread{'s' if busiest.threads != 1 else ''} on busy"
            )
    return Verdict(reasons=reasons, spread=worst, others_cores=others)
