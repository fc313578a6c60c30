"""Slow ranks named: every ``cluster.health.straggler_interval`` steps the ranks gather, in one
small all-gather, the seconds each spent per step in data, compute and communication since the
last report (``llmforge.processes.progress`` adds them up from the loop's marks). The slowest
rank's typical compute per step goes into the logged record (console, metrics.jsonl, W&B) as a
ratio to the median of the other ranks and to the estimated step time; above
``cluster.health.straggler_ratio`` rank 0 warns, naming the rank's node and device.

A rank that computes slowly makes the others wait in their reductions: their communication grows,
its own does not, so compute, not step time, tells which rank holds the others back. A rank's
typical step (the lower median of its steps) is compared, so one step stalled by another process
names nobody. The times are the host's: on a GPU, kernels queued but not finished show up where
the host next waits for them.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from llmforge.processes.progress import reporter
from llmforge.train.callbacks import Callback
from llmforge.train.components import RankInfo

_KINDS = ("data", "compute", "comm", "typical_compute")


@dataclass(frozen=True)
class Straggler:
    """The slowest rank of one report: its seconds per step and the ratios the record carries."""

    rank: int
    compute_s: float
    median_s: float
    estimate_s: float

    @property
    def ratio(self) -> float:
        return self.compute_s / self.median_s if self.median_s > 0 else 1.0

    def record(self) -> dict[str, float]:
        return {
            "straggler_rank": self.rank,
            "straggler_ratio": self.ratio,
            "straggler_vs_estimate": self.compute_s / self.estimate_s if self.estimate_s > 0 else 0.0,
            "straggler_compute_s": self.compute_s,
            "median_compute_s": self.median_s,
        }


def slowest(per_step: list[dict[str, float]], *, estimate_s: float) -> Straggler:
    """The rank with the most typical compute per step among ``per_step`` (seconds, one dict per rank),
    against the median of the others."""
    compute = [r["typical_compute"] for r in per_step]
    rank = max(range(len(compute)), key=compute.__getitem__)
    others = compute[:rank] + compute[rank + 1 :]
    return Straggler(rank=rank, compute_s=compute[rank], median_s=statistics.median(others), estimate_s=estimate_s)


class StragglerReport(Callback):
    """The report as a run part (every rank takes part in the gather; rank 0 warns). Placed
    before rank 0's writers so that the record they write carries the figures."""

    def __init__(self, *, rank: RankInfo, start_step: int, interval: int, ratio: float, estimate_s: float, console: Console) -> None:
        self.rank, self.interval, self.threshold, self.estimate_s = rank, interval, ratio, estimate_s
        self.console = console
        self.places: list[Any] = [None] * rank.world_size
        dist.all_gather_object(self.places, f"node {socket.gethostname()}, device {_device_name(rank.device)}")
        self.last_step, self.next_report = start_step, (start_step // interval + 1) * interval
        reporter.take_times()  # the start-up is no step's time

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step < self.next_report:
            return
        steps = max(1, step - self.last_step)
        self.last_step, self.next_report = step, (step // self.interval + 1) * self.interval
        straggler = slowest(self._gather(steps), estimate_s=self.estimate_s)
        record.update(straggler.record())
        if self.rank.is_main and straggler.ratio > self.threshold:
            self.console.print(self._warning(straggler, first=step - steps + 1, last=step), style="yellow", markup=False, highlight=False)

    def _gather(self, steps: int) -> list[dict[str, float]]:
        times = reporter.take_times()
        per_step = [times[k] / (1 if k == "typical_compute" else steps) for k in _KINDS]
        mine = torch.tensor(per_step, dtype=torch.float64, device=self.rank.device)
        out = torch.empty(self.rank.world_size * len(_KINDS), dtype=torch.float64, device=self.rank.device)
        dist.all_gather_single(out, mine)
        rows = out.view(self.rank.world_size, len(_KINDS)).tolist()
        return [dict(zip(_KINDS, row, strict=True)) for row in rows]

    def _warning(self, s: Straggler, *, first: int, last: int) -> str:
        return (
            f"straggler: rank {s.rank} ({self.places[s.rank]}) computed {s.compute_s:.3g} s per step over steps {first}-{last}, "
            f"{s.ratio:.2f}x the other ranks' median ({s.median_s:.3g} s) and {s.compute_s / max(s.estimate_s, 1e-12):.2f}x the "
            f"estimated step time ({s.estimate_s:.3g} s); above cluster.health.straggler_ratio={self.threshold:g}"
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index} ({torch.cuda.get_device_name(device)})"
    return str(device)


def straggler_report(plan, *, rank: RankInfo, start_step: int, estimate_s: float, console: Console) -> list[Callback]:
    """The report part of a multi-rank run with ``cluster.health.straggler_interval`` set."""
    h = plan.config.cluster.health
    if h.straggler_interval <= 0 or rank.world_size < 2 or not dist.is_initialized():
        return []
    report = StragglerReport(
        rank=rank, start_step=start_step, interval=h.straggler_interval, ratio=h.straggler_ratio, estimate_s=estimate_s, console=console
    )
    return [report]
