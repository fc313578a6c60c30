"""Where each rank's training loop is: its step, microbatch and phase, reported by the loop
itself (not by a thread, so a rank blocked in a collective stops reporting) into a small
memory-mapped file per rank that the launcher on its node reads (``llmforge.processes.hang``).

A report is one ``struct.pack_into`` into the mapping plus a clock read: about a microsecond.
The same marks add up the time each phase took since the last ``take_times`` (the straggler
report's data, compute and communication times). No torch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import struct
import time
from dataclasses import dataclass
from pathlib import Path

#: The phases a rank reports, in the order a step runs them.
PHASES = ("start", "data", "forward", "backward", "comm", "optimizer", "log", "checkpoint", "eval", "done")
#: Phases the step-time estimate does not cover: the long bound applies (with start-up and a first step).
LONG_PHASES = frozenset({"start", "checkpoint", "eval", "done"})
#: Which phases count as what in a straggler report.
TIME_KINDS = {"data": ("data",), "compute": ("forward", "backward", "optimizer"), "comm": ("comm",)}

# write count, step, steps done in this attempt, microbatch, phase, pid, attempt, monotonic time
_LAYOUT = struct.Struct("<qqqiiiid")
_INDEX = {name: i for i, name in enumerate(PHASES)}


def progress_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"progress-rank{rank}"


@dataclass(frozen=True)
class Progress:
    """One rank's last report: ``age_s`` seconds ago (read on the rank's own node)."""

    rank: int
    step: int
    steps_done: int
    microbatch: int
    phase: str
    pid: int
    attempt: int
    age_s: float

    def position(self) -> tuple[int, int, int]:
        """Orders ranks by how far they got (a rank behind the others has a smaller one)."""
        return (self.step, _INDEX.get(self.phase, 0), self.microbatch)

    def where(self) -> str:
        """``step 4, backward (microbatch 1)``."""
        micro = f" (microbatch {self.microbatch})" if self.phase in ("forward", "backward") else ""
        return f"step {self.step}, {self.phase}{micro}"


class Reporter:
    """This rank's reports: phase times always, the file once ``open`` gave it one."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._seq = 0
        self._step = self._done = self._micro = 0
        self._phase = "start"
        self._since = time.perf_counter()
        self._times = dict.fromkeys(PHASES, 0.0)
        self._step_compute: list[float] = []
        self._compute_before = 0.0
        self._pid, self._attempt = os.getpid(), 0

    def open(self, path: Path, *, attempt: int) -> None:
        """Report into ``path`` (created at the struct's size) from now on."""
        self.close()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _LAYOUT.size)
            self._map = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        self._pid, self._attempt = os.getpid(), attempt
        self._write()

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._map.close()
        self._map = None

    def mark(self, phase: str, *, step: int | None = None, microbatch: int = 0) -> None:
        """The loop enters ``phase`` (of ``step``, when it starts a new one)."""
        now = time.perf_counter()
        self._times[self._phase] += now - self._since
        self._since, self._phase, self._micro = now, phase, microbatch
        if step is not None:
            self._step = step
        if self._map is not None:
            self._write()

    def step_done(self) -> None:
        """The current step is over (the first step of an attempt is judged by the long bound)."""
        self._done += 1
        compute = self._compute()
        self._step_compute.append(compute - self._compute_before)
        self._compute_before = compute

    def take_times(self) -> dict[str, float]:
        """Seconds in data, compute and communication since the last call (the phase under way counted
        up to now), and ``typical_compute``: the lower median of the compute of the steps done since
        (one step stalled by another process on the machine does not move it)."""
        self.mark(self._phase, microbatch=self._micro)
        out = {kind: sum(self._times[p] for p in phases) for kind, phases in TIME_KINDS.items()}
        out["typical_compute"] = statistics.median_low(self._step_compute) if self._step_compute else out["compute"]
        self._times = dict.fromkeys(PHASES, 0.0)
        self._step_compute, self._compute_before = [], 0.0
        return out

    def _compute(self) -> float:
        return sum(self._times[p] for p in TIME_KINDS["compute"])

    def _write(self) -> None:
        assert self._map is not None
        self._seq += 2
        _LAYOUT.pack_into(
            self._map, 0, self._seq, self._step, self._done, self._micro, _INDEX[self._phase], self._pid, self._attempt, time.monotonic()
        )


#: The process's reporter (a rank is one process); the loop and the step seam call ``mark``.
reporter = Reporter()
mark = reporter.mark


def read_progress(folder: Path) -> dict[int, Progress]:
    """rank -> its last report, for every progress file in ``folder`` (unreadable ones left out)."""
    out = {}
    now = time.monotonic()
    for path in Path(folder).glob("progress-rank*"):
        with contextlib.suppress(OSError, ValueError, struct.error):
            rank = int(path.name[len("progress-rank") :])
            _, step, done, micro, phase, pid, attempt, at = _stable_read(path)
            out[rank] = Progress(rank, step, done, micro, PHASES[phase], pid, attempt, max(0.0, now - at))
    return out


def _stable_read(path: Path) -> tuple:
    """One report, read again while two reads differ (a write was under way)."""
    for _ in range(5):
        first = _LAYOUT.unpack(path.read_bytes()[: _LAYOUT.size])
        second = _LAYOUT.unpack(path.read_bytes()[: _LAYOUT.size])
        if first == second:
            return first
    return second
