"""torchrun in this process, for any job: its cluster options and the run itself.

The local launcher (``llmforge.launch``) and ``llmforge calibrate`` both start their
ranks so. torchrun's elastic agent runs in this process, so when a rank fails it can
show that rank's error once (user errors as the usual one-line message and exit code
2) instead of torchrun's per-rank report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from llmforge.errors import UserError, error_text
from llmforge.processes.watch import ERROR_DIR_ENV, LAUNCHER_PID_ENV, HangWatch, RankMonitor, failure_report, read_records


def cluster_args(*, nodes: int | str, per_node: int, endpoint: str | None, max_restarts: int, run_id: str) -> list[str]:
    """torchrun options for ``nodes`` (a count, or MIN:MAX) x ``per_node`` ranks (``llmforge calibrate`` starts its ranks so too)."""
    args = [f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--monitor-interval=0.2"]
    if max_restarts > 0:
        args.append(f"--max-restarts={max_restarts}")
    if str(nodes) == "1" and endpoint is None:
        return args + ["--standalone"]
    return args + ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]


def run_torchrun(
    argv: list[str],
    *,
    console: Console,
    threads: int = 1,
    hang_s: float | None = None,
    env: dict[str, str] | None = None,
    watch: HangWatch | None = None,
) -> None:
    """Run torchrun (``argv`` as after ``python -m torch.distributed.run``) here.

    The ranks die with this process (see ``llmforge.processes.watch``); with ``hang_s``
    a rank silent for that long ends the job, with ``watch`` a rank whose loop makes no progress. On failure the root cause is shown
    once, as plain text: a user error is raised as a UserError (exit code 2),
    anything else is printed and ends the process with exit code 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    base = {LAUNCHER_PID_ENV: str(os.getpid()), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    with tempfile.TemporaryDirectory(prefix="llmforge-errors-") as folder, _quiet_agent():
        with _env({**base, ERROR_DIR_ENV: folder, **(env or {})}), RankMonitor(Path(folder), hang_s=hang_s, watch=watch) as monitor:
            try:
                run(parse_args(argv))
                return
            except SignalException as exc:
                # torchrun forwarded SIGTERM/SIGINT to the ranks, which finish the step,
                # save and print the resume command: a requested stop, not a failure.
                console.print(f"stopped by {exc.sigval.name}", style="yellow", highlight=False)
                return
            except ChildFailedError as exc:
                monitor.settle()  # a rank may fail of a hang that is being explained
                codes = {rank: info.exitcode for rank, info in exc.failures.items()}
                report = failure_report(
                    Path(folder),
                    exit_codes=codes,
                    hung=monitor.hung,
                    hang_s=hang_s,
                    ended=monitor.ended,
                    ranks=set(monitor.heartbeats()),
                    hang_text=monitor.report,
                )
                tracebacks = [r["traceback"] for r in read_records(Path(folder)) if r.get("traceback")]
    if report.user:
        raise RankUserError(rank=report.rank, text=report.text)
    if tracebacks and os.environ.get("LLMFORGE_TRACEBACK"):
        console.print(tracebacks[0], markup=False, highlight=False, soft_wrap=True)
    console.print(error_text(report.text), highlight=False, soft_wrap=True)
    raise SystemExit(1)


class RankUserError(UserError):
    """A user error raised on one rank, shown as that rank reported it."""

    def __init__(self, *, rank: int, text: str) -> None:
        self.rank, self.text = rank, text
        super().__init__(text)

    def message(self) -> str:
        return getattr(self, "text", "") or super().message()


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """torchrun's agent logs each stopped rank; the launcher reports the failure itself."""
    logger = logging.getLogger("torch.distributed.elastic")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
