"""How busy the machine was while a calibration measured it (no torch).

A calibration measures what the machine can do; other processes computing on the same
CPUs at the time make it measure less (two calibrations at once measured each other at
under half the real rate). ``CpuLoad`` counts the CPU seconds spent on this process's
CPUs during a stretch of time (``/proc/stat``, steal included: a hypervisor's other
guests) and takes away this process's own and its waited-for children's (``os.times``): what is
left is the others'.
Its readers and clock are arguments, so that tests hand it figures instead of a machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: /proc/stat fields after the CPU's name (user nice system idle iowait irq softirq steal) that count as idle.
IDLE_FIELDS = (3, 4)


@dataclass(frozen=True)
class LoadReading:
    """Over one stretch of measuring: its wall time, the CPU seconds other processes used on
    this process's CPUs, how many CPUs that is, and the threads the calibration computed with."""

    wall_s: float
    others_cpu_s: float
    cpus: int
    threads: int

    @property
    def others_cores(self) -> float:
        """CPUs' worth of other processes' work, on average over the stretch."""
        return max(0.0, self.others_cpu_s) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def contention(self) -> float:
        """Share of the calibration's threads the others took: their work beyond the CPUs it left idle."""
        spare = max(0, self.cpus - self.threads)
        return max(0.0, self.others_cores - spare) / max(1, min(self.threads, self.cpus))


def my_cpus() -> frozenset:
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))


def busy_cpu_seconds(cpus: frozenset, *, stat: Path = Path("/proc/stat")) -> float | None:
    """CPU seconds spent busy (not idle, not waiting for I/O) on ``cpus`` since boot; None where
    the kernel does not say (not Linux, or a container's /proc/stat without those CPUs)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    total, seen = 0, set()
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]
            total += sum(values) - sum(values[i] for i in IDLE_FIELDS)
            seen.add(int(name[3:]))
    return total / tick if seen == set(cpus) else None


def own_cpu_seconds(times: Callable[[], os.times_result] = os.times) -> float:
    """CPU seconds of this process (every thread) and of the children it has waited for: a
    calibration's own subprocesses (the DTensor host probe, ``llmforge.calibrate.host_probe``)
    are its own work, not other processes' load."""
    t = times()
    return t.user + t.system + t.children_user + t.children_system


class CpuLoad:
    """``start()``, measure, ``stop()`` -> a LoadReading (None where the machine does not say)."""

    def __init__(
        self,
        *,
        threads: int,
        cpus: frozenset | None = None,
        busy: Callable[[], float | None] | None = None,
        own: Callable[[], float] = own_cpu_seconds,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.threads = threads
        self.cpus = cpus if cpus is not None else my_cpus()
        self.busy = busy or (lambda: busy_cpu_seconds(self.cpus))
        self.own, self.clock = own, clock
        self._start: tuple[float, float | None, float] | None = None

    def start(self) -> None:
        self._start = (self.clock(), self.busy(), self.own())

    def stop(self) -> LoadReading | None:
        assert self._start is not None, "start() first"
        wall0, busy0, own0 = self._start
        wall, busy, own = self.clock() - wall0, self.busy(), self.own() - own0
        if busy is None or busy0 is None or wall <= 0:
            return None
        return LoadReading(wall_s=wall, others_cpu_s=(busy - busy0) - own, cpus=len(self.cpus), threads=self.threads)
