"""Start a distributed run: torchrun locally or across nodes, or an sbatch script.

Every rank runs ``llmforge.parallel.worker`` with the saved ``plan.json``. The
local launcher runs torchrun's elastic agent in this process, so when a rank
fails it can show that rank's error once (user errors as the usual one-line
message and exit code 2) instead of torchrun's per-rank report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from rich.console import Console

from llmforge.errors import Problem, UserError
from llmforge.plan import RunPlan

WORKER = "llmforge.parallel.worker"
RESTART_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
DEFAULT_PORT = 29500


def check_supported(plan: RunPlan) -> List[Problem]:
    """Layouts the plan allows but this backend cannot run, and launch settings it needs."""
    out = []
    if plan.cp > 1 and plan.pp > 1:
        out.append(Problem("parallel.cp", plan.cp, f"context parallelism is not supported with pipeline parallelism (parallel.pp={plan.pp})", "set parallel.cp=1 or parallel.pp=1"))
    if plan.cp > 1 and plan.config.model.moe.num_experts > 0:
        out.append(Problem("parallel.cp", plan.cp, "context parallelism is not supported with MoE models (model.moe.num_experts > 0): routing and the router losses would see only a slice of each sequence", "set parallel.cp=1 or model.moe.num_experts=0"))
    c = plan.config.cluster
    if c.nodes > 1 and c.launcher != "slurm" and not c.rdzv_endpoint:
        out.append(Problem("cluster.rdzv_endpoint", None, "a multi-node run needs a rendezvous address every node can reach", "set cluster.rdzv_endpoint=HOST:PORT (the first node) or cluster.launcher=slurm"))
    if plan.world_size % c.nodes:
        out.append(Problem("cluster.nodes", c.nodes, f"does not divide the world size {plan.world_size}", "set cluster.devices_per_node"))
    return out


def procs_per_node(plan: RunPlan) -> int:
    c = plan.config.cluster
    return c.devices_per_node or plan.world_size // c.nodes


def torchrun_args(plan: RunPlan, *, endpoint: Optional[str] = None, run_id: str = "llmforge") -> List[str]:
    """torchrun options for this plan (same on every node)."""
    c = plan.config.cluster
    args = [f"--nnodes={c.nodes}", f"--nproc-per-node={procs_per_node(plan)}", "--monitor-interval=0.2"]
    if c.max_restarts > 0:
        args.append(f"--max-restarts={c.max_restarts}")
    endpoint = endpoint or c.rdzv_endpoint
    if c.nodes == 1 and endpoint is None:
        return args + ["--standalone"]
    return args + ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]


def worker_args(*, plan_path: Path, resume_from: Optional[Path]) -> List[str]:
    args = ["-m", WORKER, "--plan", str(plan_path)]
    return args + (["--resume", str(resume_from)] if resume_from is not None else [])


def torchrun_command(plan: RunPlan, *, plan_path: Path, resume_from: Optional[Path]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(plan, run_id=plan.config.run.name), *worker_args(plan_path=plan_path, resume_from=resume_from)]


def slurm_script(plan: RunPlan, *, plan_path: Path, resume_from: Optional[Path]) -> str:
    """An sbatch script running the same torchrun command on every node under srun."""
    c = plan.config.cluster
    endpoint = c.rdzv_endpoint or f"$head_node:{DEFAULT_PORT}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(plan, endpoint="RDZV_ENDPOINT", run_id="RDZV_ID")]
    command = " ".join(shlex.quote(a) for a in torchrun + worker_args(plan_path=plan_path, resume_from=resume_from))
    # Substituted after quoting so that the shell expands them on each node.
    command = command.replace("RDZV_ENDPOINT", endpoint).replace("RDZV_ID", "$SLURM_JOB_ID")
    gpus = [] if c.accelerator == "cpu" else [f"#SBATCH --gpus-per-node={procs_per_node(plan)}"]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={plan.config.run.name}",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1",
        *gpus,
        f"#SBATCH --output={plan.run_dir.resolve()}/slurm-%j.out",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        *[f"export {k}={v}" for k, v in restart_env(plan).items()],
        f"srun --kill-on-bad-exit=1 {command}",
    ]
    return "\n".join(lines) + "\n"


def launch_distributed(plan: RunPlan, *, resume_from: Optional[Path], dry_run: bool, console: Console) -> None:
    """Run ``plan`` on all its ranks (or write/print the SLURM script)."""
    problems = check_supported(plan)
    if problems:
        raise UserError(problems, title="this layout cannot be launched")
    plan_path = (plan.run_dir / "plan.json").resolve()
    if plan.config.cluster.launcher == "slurm":
        _slurm(plan, plan_path=plan_path, resume_from=resume_from, dry_run=dry_run, console=console)
        return
    command = torchrun_command(plan, plan_path=plan_path, resume_from=resume_from)
    if dry_run:
        console.print("would run on every node:\n" + " ".join(shlex.quote(a) for a in command), highlight=False, soft_wrap=True)
        return
    plan.save(plan_path)
    if plan.config.cluster.nodes > 1:
        console.print(f"start the same command on each of the {plan.config.cluster.nodes} nodes", highlight=False)
    run_torchrun(command[3:], console=console, threads=_threads(plan), env=restart_env(plan))


def _slurm(plan: RunPlan, *, plan_path: Path, resume_from: Optional[Path], dry_run: bool, console: Console) -> None:
    script = slurm_script(plan, plan_path=plan_path, resume_from=resume_from)
    if dry_run:
        console.print(script, highlight=False, markup=False, soft_wrap=True)
        return
    plan.save(plan_path)
    path = plan.run_dir / "launch.sbatch"
    tmp = path.with_suffix(".sbatch.tmp")
    tmp.write_text(script)
    tmp.replace(path)
    console.print(f"wrote {path}; submit it with: sbatch {path}", highlight=False)


def _threads(plan: RunPlan) -> int:
    return max(1, (os.cpu_count() or 1) // procs_per_node(plan))


def restart_env(plan: RunPlan) -> Dict[str, str]:
    """With restarts, every attempt gets a fresh rendezvous store: on the agent's shared
    store (torch's default) a restarted group reads the failed attempt's keys and hangs."""
    return {RESTART_STORE_ENV: "1"} if plan.config.cluster.max_restarts > 0 else {}


def run_torchrun(argv: List[str], *, console: Console, threads: int = 1, env: Optional[Dict[str, str]] = None) -> None:
    """Run torchrun (``argv`` as after ``python -m torch.distributed.run``) here.

    On failure the first failing rank's error is shown once: a user error is
    raised as a UserError (exit code 2), anything else is printed and ends the
    process with exit code 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    with tempfile.TemporaryDirectory(prefix="llmforge-errors-") as folder, _quiet_agent():
        with _env({"LLMFORGE_ERROR_DIR": folder, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)), **(env or {})}):
            try:
                run(parse_args(argv))
                return
            except SignalException as exc:
                # torchrun forwarded SIGTERM/SIGINT to the ranks, which finish the step,
                # save and print the resume command: a requested stop, not a failure.
                console.print(f"[yellow]stopped by {exc.sigval.name}[/]", highlight=False)
                return
            except ChildFailedError as exc:
                record = _first_error(Path(folder))
                failure = exc
    if record is None:
        rank, info = failure.get_first_failure()
        console.print(f"[bold red]error:[/] rank {rank} exited with code {info.exitcode} without a report", highlight=False)
        raise SystemExit(1)
    if record["kind"] == "user":
        raise RankUserError(rank=record["rank"], text=record["message"])
    from rich.markup import escape

    console.print(f"[bold red]rank {record['rank']} failed:[/]\n{escape(record['message'])}", highlight=False, markup=True, soft_wrap=True)
    raise SystemExit(1)


class RankUserError(UserError):
    """A user error raised on one rank, shown as that rank reported it."""

    def __init__(self, *, rank: int, text: str) -> None:
        self.rank, self.text = rank, text
        super().__init__(text)

    def message(self) -> str:
        return getattr(self, "text", "") or super().message()


def _first_error(folder: Path) -> Optional[Dict]:
    """The earliest report: the rank that failed first (the others then lose their peers)."""
    records = []
    for path in folder.glob("rank*.json"):
        with contextlib.suppress(ValueError, OSError):
            records.append(json.loads(path.read_text()))
    # the last attempt's failure when torchrun restarted the ranks (cluster.max_restarts)
    return min(records, key=lambda r: (-r.get("attempt", 0), r["time"])) if records else None


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
