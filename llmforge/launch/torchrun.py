"""torchrun for a plan: its command line (locally or across nodes), and the run itself.

Every rank runs ``llmforge.launch.worker`` with the saved ``plan.json``. The
local launcher runs torchrun's elastic agent in this process, so when a rank
fails it can show that rank's error once (user errors as the usual one-line
message and exit code 2) instead of torchrun's per-rank report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from rich.console import Console

from llmforge.elastic import is_elastic
from llmforge.errors import Problem, UserError, error_text
from llmforge.plan import RunPlan

WORKER = "llmforge.launch.worker"
RESTART_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def check_supported(plan: RunPlan) -> List[Problem]:
    """Launch settings a run needs (the layout's own rules, backend limits included, are
    the plan's: ``llmforge.layout``)."""
    out = []
    c = plan.config.cluster
    if c.nodes > 1 and c.launcher != "slurm" and not c.rdzv_endpoint:
        out.append(Problem("cluster.rdzv_endpoint", None, "a multi-node run needs a rendezvous address every node can reach", "set cluster.rdzv_endpoint=HOST:PORT (the first node) or cluster.launcher=slurm"))
    if plan.world_size % c.nodes:
        out.append(Problem("cluster.nodes", c.nodes, f"does not divide the world size {plan.world_size}", "set cluster.devices_per_node"))
    return out


def procs_per_node(plan: RunPlan) -> int:
    from llmforge.estimate.shape import ranks_per_node

    return ranks_per_node(plan)


def torchrun_args(plan: RunPlan, *, endpoint: Optional[str] = None, run_id: str = "llmforge") -> List[str]:
    """torchrun options for this plan (same on every node); an elastic plan
    (``cluster.min_nodes``) runs on MIN:MAX nodes."""
    c = plan.config.cluster
    nodes = f"{c.min_nodes}:{c.nodes}" if is_elastic(plan.config) else str(c.nodes)
    args = cluster_args(nodes=nodes, per_node=procs_per_node(plan), endpoint=endpoint or c.rdzv_endpoint, max_restarts=c.max_restarts, run_id=run_id)
    return args + ([rendezvous_conf(c.elastic_wait_s)] if is_elastic(plan.config) and "--standalone" not in args else [])


def cluster_args(*, nodes: "int | str", per_node: int, endpoint: Optional[str], max_restarts: int, run_id: str) -> List[str]:
    """torchrun options for ``nodes`` (a count, or MIN:MAX) x ``per_node`` ranks (``llmforge calibrate`` starts its ranks so too)."""
    args = [f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--monitor-interval=0.2"]
    if max_restarts > 0:
        args.append(f"--max-restarts={max_restarts}")
    if str(nodes) == "1" and endpoint is None:
        return args + ["--standalone"]
    return args + ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]


def rendezvous_conf(wait_s: int) -> str:
    """The c10d rendezvous timing of an elastic run: wait ``wait_s`` for more nodes once the
    minimum is there; a node whose agent is silent for 3 keep-alives (about half of it) is dropped."""
    keep_alive = max(1, min(5, wait_s // 6))
    return f"--rdzv-conf=last_call_timeout={wait_s},keep_alive_interval={keep_alive},keep_alive_max_attempt=3"


def worker_args(*, plan_path: Path, resume_from: Optional[Path]) -> List[str]:
    args = ["-m", WORKER, "--plan", str(plan_path)]
    return args + (["--resume", str(resume_from)] if resume_from is not None else [])


def torchrun_command(plan: RunPlan, *, plan_path: Path, resume_from: Optional[Path]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(plan, run_id=plan.config.run.name), *worker_args(plan_path=plan_path, resume_from=resume_from)]


def start(plan: RunPlan, *, plan_path: Path, resume_from: Optional[Path], dry_run: bool, console: Console) -> None:
    """Start torchrun for ``plan`` on this node (its plan.json already written), or with
    ``dry_run`` print the command."""
    command = torchrun_command(plan, plan_path=plan_path, resume_from=resume_from)
    if dry_run:
        console.print(dry_run_text(command, plan_path=plan_path), highlight=False, soft_wrap=True, markup=False)
        return
    if plan.config.cluster.nodes > 1:
        console.print(f"start the same command on each of the {plan.config.cluster.nodes} nodes", highlight=False)
    run_torchrun(command[3:], console=console, threads=_threads(plan), hang_s=plan.config.cluster.timeout_s / 2, env=restart_env(plan))


def dry_run_text(command: List[str], *, plan_path: Path) -> str:
    """What ``--dry-run`` prints: the command, and the plan file it needs (not written)."""
    return (
        f"would write the plan to {plan_path} and run on every node:\n" + " ".join(shlex.quote(a) for a in command)
        + f"\n(--dry-run writes nothing; to run the command by hand, first write the plan with the same arguments: "
        f"llmforge plan ... --json > {shlex.quote(str(plan_path))})"
    )


def restart_env(plan: RunPlan) -> Dict[str, str]:
    """With restarts, every attempt gets a fresh rendezvous store: on the agent's shared
    store (torch's default) a restarted group reads the failed attempt's keys and hangs."""
    return {RESTART_STORE_ENV: "1"} if plan.config.cluster.max_restarts > 0 else {}


def _threads(plan: RunPlan) -> int:
    from llmforge.hardware import cpu_threads

    return cpu_threads(procs_per_node(plan))


def run_torchrun(argv: List[str], *, console: Console, threads: int = 1, hang_s: Optional[float] = None, env: Optional[Dict[str, str]] = None) -> None:
    """Run torchrun (``argv`` as after ``python -m torch.distributed.run``) here.

    The ranks die with this process (see ``llmforge.launch.watch``); with ``hang_s``
    a rank silent for that long ends the job. On failure the root cause is shown
    once, as plain text: a user error is raised as a UserError (exit code 2),
    anything else is printed and ends the process with exit code 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from llmforge.launch.watch import ERROR_DIR_ENV, LAUNCHER_PID_ENV, RankMonitor, failure_report, read_records

    base = {LAUNCHER_PID_ENV: str(os.getpid()), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    with tempfile.TemporaryDirectory(prefix="llmforge-errors-") as folder, _quiet_agent():
        with _env({**base, ERROR_DIR_ENV: folder, **(env or {})}), RankMonitor(Path(folder), hang_s=hang_s) as monitor:
            try:
                run(parse_args(argv))
                return
            except SignalException as exc:
                # torchrun forwarded SIGTERM/SIGINT to the ranks, which finish the step,
                # save and print the resume command: a requested stop, not a failure.
                console.print(f"stopped by {exc.sigval.name}", style="yellow", highlight=False)
                return
            except ChildFailedError as exc:
                codes = {rank: info.exitcode for rank, info in exc.failures.items()}
                report = failure_report(Path(folder), exit_codes=codes, hung=monitor.hung, hang_s=hang_s, ended=monitor.ended, ranks=set(monitor.heartbeats()))
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
def _env(values: Dict[str, str]) -> Iterator[None]:
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
