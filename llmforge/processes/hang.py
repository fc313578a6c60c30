"""A hang, found from the ranks' progress (``llmforge.processes.progress``) and explained.

A rank is hung when its training loop reports nothing for longer than its bound: a multiple of
the plan's estimated step time (``cluster.health.hang_factor``, never below ``hang_floor_s``), or
``hang_long_s`` for what the estimate does not time (start-up, an attempt's first step with its
compile and warm-up, checkpoints, evaluation). The launcher on each node then has every rank dump
its stacks and flight recorder into ``run.dir/hangs/attemptN/`` (``llmforge.processes.dumps``) and
says in one message which ranks are behind, where every rank is and which collective it waits in.
No torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from llmforge.processes.dumps import DUMP_SIGNAL, FLIGHT_RECORDER, REQUEST, InFlight, in_flight, stack_path
from llmforge.processes.progress import LONG_PHASES, Progress

ANALYSER = "python -m torch.distributed.flight_recorder.fr_trace"
_DUMP_WAIT_S = 3.0


@dataclass(frozen=True)
class HangBounds:
    """How long a rank may report nothing (``cluster.health``, with the plan's estimated step time)."""

    step_s: float
    factor: float
    floor_s: float
    long_s: float

    @property
    def step_bound_s(self) -> float:
        return max(self.floor_s, self.factor * self.step_s)

    def bound(self, p: Progress) -> float:
        """The bound for where ``p`` is: the long one at start-up, in an attempt's first step and in untimed phases."""
        return self.long_s if p.phase in LONG_PHASES or p.steps_done == 0 else self.step_bound_s

    def why(self, p: Progress) -> str:
        if self.bound(p) == self.step_bound_s and self.step_bound_s > self.floor_s:
            return f"cluster.health.hang_factor={self.factor:g} x the estimated step time {self.step_s:.3g} s"
        if self.bound(p) == self.step_bound_s:
            return "cluster.health.hang_floor_s"
        return f"cluster.health.hang_long_s, for {'the first step' if p.phase not in LONG_PHASES else p.phase}"


def stale(progress: dict[int, Progress], bounds: HangBounds) -> list[int]:
    """The ranks silent for longer than their bound."""
    return sorted(r for r, p in progress.items() if p.age_s > bounds.bound(p))


def behind(progress: dict[int, Progress]) -> list[int]:
    """The ranks that got least far (all of them when every rank is at the same point)."""
    if not progress:
        return []
    least = min(p.position() for p in progress.values())
    return sorted(r for r, p in progress.items() if p.position() == least)


def collect_dumps(error_folder: Path, *, dest: Path, pids: dict[int, int], others: tuple[int, ...] = ()) -> list[Path]:
    """Ask every rank in ``pids`` (rank -> pid) for its stacks and flight recorder; copy what they
    wrote into ``dest``; wait for the flight recorders of ``others`` (ranks of other nodes, whose
    launchers dump them, seen here when run.dir is shared). Waits at most a few seconds; returns
    the files written."""
    dest.mkdir(parents=True, exist_ok=True)
    (error_folder / REQUEST).write_text(str(dest))
    for pid in pids.values():
        with contextlib.suppress(OSError):
            os.kill(pid, DUMP_SIGNAL)
    deadline = time.monotonic() + _DUMP_WAIT_S
    while time.monotonic() < deadline and not _all_dumped(error_folder, dest=dest, ranks=list(pids), others=others):
        time.sleep(0.1)
    time.sleep(0.2)  # a dump seen started is given a moment to finish
    for rank in sorted(pids):
        source = stack_path(error_folder, rank)
        with contextlib.suppress(OSError):
            if source.stat().st_size:
                shutil.copyfile(source, stack_path(dest, rank))
    return sorted(dest.glob("stack-rank*.txt"), key=_rank_of) + sorted((dest / FLIGHT_RECORDER).glob("rank_*"), key=_rank_of)


def _rank_of(path: Path) -> int:
    digits = "".join(ch for ch in path.name if ch.isdigit())
    return int(digits or 0)


def _all_dumped(error_folder: Path, *, dest: Path, ranks: list[int], others: tuple[int, ...]) -> bool:
    stacks = all(_size(stack_path(error_folder, r)) for r in ranks) and all(_size(stack_path(dest, r)) for r in others)
    return stacks and all((dest / FLIGHT_RECORDER / f"rank_{r}").exists() for r in [*ranks, *others])


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def hang_message(
    *, hung: list[int], progress: dict[int, Progress], bounds: HangBounds, dest: Path, files: list[Path], restarts_left: bool
) -> str:
    """One message: who stopped, who is behind, where every rank is and what it waits in, the files written."""
    first = progress[hung[0]]
    lines = [
        f"hang: rank {', '.join(map(str, hung))} made no progress for {first.age_s:.1f} s "
        f"(bound {bounds.bound(first):.3g} s: {bounds.why(first)})",
        f"behind: rank {', '.join(map(str, behind(progress)))}",
    ]
    flights = {rank: in_flight(dest / FLIGHT_RECORDER / f"rank_{rank}") for rank in progress}
    for rank in sorted(progress):
        p = progress[rank]
        lines.append(f"  rank {rank}: {p.where()}, last report {p.age_s:.1f} s ago{waiting(rank, flights)}")
    stacks = [f for f in files if f.name.startswith("stack-")]
    lines.append(f"stacks of every thread: {', '.join(str(f) for f in stacks) or 'none written'}")
    if any(f.parent.name == FLIGHT_RECORDER for f in files):
        lines.append(f"flight recorder: {dest / FLIGHT_RECORDER} (read it with `{ANALYSER} {dest / FLIGHT_RECORDER}`)")
    lines.append(
        "the ranks were stopped; "
        + (
            "they restart from the newest complete checkpoint (cluster.max_restarts)"
            if restarts_left
            else "if the ranks were only slow, raise cluster.health.hang_floor_s or cluster.health.hang_factor"
        )
    )
    return "\n".join(lines)


def waiting(rank: int, flights: dict[int, list[InFlight]]) -> str:
    """``; waits in gloo:all_reduce #29 of process group 0, which rank 1 has not issued`` (from the flight recorders), or ""."""
    under_way = [f for f in flights[rank] if f.issued > f.completed]
    if not under_way:
        newest = ", ".join(f"#{f.issued} of process group {f.group}" for f in flights[rank] if f.issued > 0)
        return f"; no collective under way (newest issued: {newest})" if newest else ""
    f = under_way[0]
    seq = f.completed + 1
    missing = sorted(r for r, groups in flights.items() if any(g.group == f.group and g.issued < seq for g in groups))
    absent = f", which rank {', '.join(map(str, missing))} has not issued" if missing else ""
    return f"; waits in {f.name or 'a collective'} #{seq} of process group {f.group}{absent}"


def stop_ranks(pids: dict[int, int]) -> None:
    for pid in pids.values():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
