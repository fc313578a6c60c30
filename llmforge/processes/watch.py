"""Keep a local multi-process job honest: ranks die with their launcher, a rank that
stops answering ends the job and is named, and a failure is reported as it happened.

Worker side (``guard_rank``): the rank asks the kernel for SIGKILL when its launcher
dies (``PR_SET_PDEATHSIG`` on Linux) and a watchdog thread checks the launcher's pid
every second as well, so a SIGKILLed launcher (the OOM killer) never leaves ranks
training and rotating checkpoints as orphans. The same thread touches the rank's
heartbeat file in the launcher's error folder.

Launcher side (``RankMonitor``): a thread reads the heartbeats; a rank whose heartbeat
is older than ``hang_s`` (half of ``cluster.timeout_s``, so it is found before its peers'
collectives time out) is taken as hung and every rank is killed. ``failure_report``
then turns what the ranks left behind into one plain-text message.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmforge.processes.dumps import RankDumps
from llmforge.processes.hang import HangBounds, collect_dumps, hang_message, stale, stop_ranks
from llmforge.processes.nodes import NodeBoard, Notice
from llmforge.processes.progress import progress_path, read_progress, reporter

ERROR_DIR_ENV = "LLMFORGE_ERROR_DIR"
LAUNCHER_PID_ENV = "LLMFORGE_LAUNCHER_PID"
HEARTBEAT_S = 1.0
_TICK_S = 0.25
_PR_SET_PDEATHSIG = 1


def guard_rank(rank: int) -> None:
    """End this process when its launcher dies; keep its heartbeat fresh; report progress and
    answer dump requests into the launcher's error folder."""
    launcher = int(os.environ.get(LAUNCHER_PID_ENV) or 0) or os.getppid()
    _die_with_parent()
    if os.getppid() != launcher:  # the launcher died before the guard was in place
        os.kill(os.getpid(), signal.SIGKILL)
    folder = os.environ.get(ERROR_DIR_ENV)
    beat = Path(folder) / f"hb-rank{rank}" if folder else None
    dumps = None
    if folder:
        with contextlib.suppress(OSError):
            Path(beat).write_text(str(os.getpid()))  # type: ignore[arg-type]
            dumps = RankDumps(Path(folder), rank=rank)
            reporter.open(progress_path(Path(folder), rank), attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0))

    def watch() -> None:
        ticks = 0
        while True:
            time.sleep(_TICK_S)
            ticks += 1
            if os.getppid() != launcher:
                os.kill(os.getpid(), signal.SIGKILL)  # no save, no cleanup: the job is gone
            if dumps is not None:
                dumps.answer()
            if beat is not None and ticks % round(HEARTBEAT_S / _TICK_S) == 0:
                with contextlib.suppress(OSError):
                    os.utime(beat)

    threading.Thread(target=watch, name="llmforge-watch", daemon=True).start()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no-op elsewhere)."""
    if not os.uname().sysname == "Linux":
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _alive(pid: int) -> bool:
    """True for a running (or stopped) process, False for a gone or zombie one."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


@dataclass(frozen=True)
class HangWatch:
    """What the monitor needs to judge and explain a hang: the bounds, where dumps go
    (``run.dir/hangs``), the restarts torchrun has, and how to say it."""

    bounds: HangBounds
    dump_root: Path
    max_restarts: int
    say: Callable[[str], None]
    board: NodeBoard | None = None  # the other nodes, across the rendezvous store (multi-node runs)


class RankMonitor:
    """A launcher thread that notes when each rank ended and, with ``hang_s``, kills
    the job when a rank's heartbeat goes stale; with ``watch``, when a rank's training loop
    reports no progress within its bound (after every rank dumped its stacks)."""

    def __init__(self, folder: Path, *, hang_s: float | None, watch: HangWatch | None = None) -> None:
        self.folder, self.hang_s, self.watch = Path(folder), hang_s, watch
        self.hung: list[int] = []
        self.report = ""  # the last hang's message
        self._reported_attempt = 0
        self.ended: dict[int, float] = {}  # rank -> when its process was first seen gone
        self._done = threading.Event()
        self._handling = threading.Lock()  # held while a hang is dumped and explained
        self._handled: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="llmforge-monitor", daemon=True)

    def __enter__(self) -> RankMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def heartbeats(self) -> dict[int, tuple]:
        """rank -> (pid, seconds since its last heartbeat)."""
        beats = {}
        for path in self.folder.glob("hb-rank*"):
            with contextlib.suppress(OSError, ValueError):
                beats[int(path.name[len("hb-rank") :])] = (int(path.read_text()), time.time() - path.stat().st_mtime)
        return beats

    def _run(self) -> None:
        while not self._done.wait(_POLL_S):
            beats = {}
            for rank, (pid, age) in self.heartbeats().items():
                if _alive(pid):
                    beats[rank] = (pid, age)
                else:
                    self.ended.setdefault(rank, time.time())
            live = {r: b for r, b in beats.items() if b[0] not in self._handled}
            silent = sorted(r for r, (_, age) in live.items() if self.hang_s and age > self.hang_s)
            if silent:
                self.hung = silent
                for pid, _ in live.values():
                    self._handled.add(pid)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            elif self.watch is not None:
                with self._handling:
                    self._check_progress(self.watch)

    def settle(self, timeout_s: float = 15.0) -> None:
        """Wait until a hang being dumped and explained is (the job's failure report reads it)."""
        if self._handling.acquire(timeout=timeout_s):
            self._handling.release()

    def _check_progress(self, watch: HangWatch) -> None:
        """Dump, explain and stop when a live rank's progress is older than its bound, or when
        another node announced a hang of this attempt."""
        progress = {r: p for r, p in read_progress(self.folder).items() if p.pid not in self._handled and _alive(p.pid)}
        if not progress:
            return
        attempt = max(p.attempt for p in progress.values())
        if self.report and attempt > self._reported_attempt:  # restarted after it: a later failure is its own
            self.hung, self.report = [], ""
        notice = watch.board.announced() if watch.board is not None else None
        if notice is not None and notice.attempt == attempt:
            self._stopped_by(notice, progress=progress, watch=watch)
            return
        if watch.board is not None:
            watch.board.publish(progress)
        hung = stale(progress, watch.bounds)
        if not hung:
            return
        dest = watch.dump_root / f"attempt{attempt}"
        if watch.board is not None:
            watch.board.announce(attempt=attempt, dest=dest)
        everyone = {**(watch.board.others() if watch.board is not None else {}), **progress}
        pids = {r: p.pid for r, p in progress.items()}
        self._handled.update(pids.values())
        files = collect_dumps(self.folder, dest=dest, pids=pids, others=tuple(sorted(set(everyone) - set(progress))))
        self.report = hang_message(
            hung=hung, progress=everyone, bounds=watch.bounds, dest=dest, files=files, restarts_left=attempt < watch.max_restarts
        )
        self.hung, self._reported_attempt = hung, attempt
        with contextlib.suppress(OSError):
            (dest / "report.txt").write_text(self.report + "\n")
        stop_ranks(pids)
        if attempt < watch.max_restarts:  # else the job's failure report says it, once
            watch.say(self.report)

    def _stopped_by(self, notice: Notice, *, progress: dict, watch: HangWatch) -> None:
        """Another node found the job hung: dump this node's ranks where it said, and stop them."""
        pids = {r: p.pid for r, p in progress.items()}
        self._handled.update(pids.values())
        collect_dumps(self.folder, dest=notice.dest, pids=pids)
        stop_ranks(pids)
        self.hung, self._reported_attempt = sorted(pids), notice.attempt
        self.report = (
            f"node {notice.node} found the job hung (its message names every rank); rank {', '.join(map(str, sorted(pids)))} "
            f"of this node wrote their stacks and flight recorder into {notice.dest} and were stopped"
        )
        if notice.attempt < watch.max_restarts:
            watch.say(self.report)


@dataclass
class FailureReport:
    """What the launcher says about a failed job: one message, and whether it is a user error."""

    text: str
    user: bool = False
    rank: int = 0


def read_records(folder: Path) -> list[dict]:
    """Error records the ranks wrote, earliest first; only the last attempt's when torchrun
    restarted the ranks (cluster.max_restarts)."""
    records = []
    for path in Path(folder).glob("rank*.json"):
        with contextlib.suppress(ValueError, OSError):
            records.append(json.loads(path.read_text()))
    last = max((r.get("attempt", 0) for r in records), default=0)
    return sorted((r for r in records if r.get("attempt", 0) == last), key=lambda r: r["time"])


def failure_report(
    folder: Path,
    *,
    exit_codes: dict[int, int],
    hung: list[int],
    hang_s: float | None,
    ended: dict[int, float] | None = None,
    ranks: set[int] = frozenset(),
    hang_text: str = "",
) -> FailureReport:
    """The root cause of a failed job: the earliest of the ranks' error records and of
    their deaths by a signal the launcher does not send itself (SIGKILL from the OOM
    killer, SIGSEGV, ...). A stale heartbeat (``hung``) outranks both."""
    if hung and hang_text:
        return FailureReport(hang_text, rank=hung[0])
    if hung:
        who = ", ".join(str(r) for r in hung)
        return FailureReport(
            f"rank {who} stopped answering: no sign of life for {hang_s:g} s, so the job was stopped "
            f"(a rank silent for half of cluster.timeout_s is taken as hung; raise cluster.timeout_s if it was only slow)",
            rank=hung[0],
        )
    records = read_records(folder)
    reported = {r["rank"] for r in records}
    killed = {rank: -code for rank, code in exit_codes.items() if code < 0 and rank not in reported and -code not in _STOP_SIGNALS}
    # A death is seen up to one poll late; one unseen (or seen while the others were still
    # writing their errors) came first. The launcher's own SIGKILL comes much later.
    first_record = records[0]["time"] if records else float("inf")
    early = {r: s for r, s in killed.items() if (ended or {}).get(r, 0.0) <= first_record + _LATE_S}
    if records and not early:
        first = records[0]
        text = first["message"] if first["kind"] == "user" else f"rank {first['rank']} failed: {first['message']}"
        silent = sorted((set(ranks) | set(exit_codes)) - reported - set(killed))
        if "timed out" in first["message"].lower() and silent:
            text += f"\nrank {', '.join(map(str, silent))} reported no error: the collective was waiting for it"
        return FailureReport(text, user=first["kind"] == "user", rank=first["rank"])
    if early:
        lines = [_killed_line(rank, signum) for rank, signum in sorted(early.items())]
        if records:
            lines.append(f"then rank {records[0]['rank']} failed: {records[0]['message']}")
        return FailureReport("\n".join(lines), rank=min(early))
    rank, code = min(exit_codes.items()) if exit_codes else (0, 1)
    how = f"was stopped by {signal.Signals(-code).name}" if code < 0 and -code in _STOP_SIGNALS else f"exited with code {code}"
    return FailureReport(f"rank {rank} {how} without a report", rank=rank)


_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}
_POLL_S = 0.25
_LATE_S = 1.0


def _killed_line(rank: int, signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    why = " (the kernel's out-of-memory killer sends SIGKILL; so does `kill -9`)" if signum == signal.SIGKILL else ""
    return f"rank {rank} was killed by {name}{why}"
