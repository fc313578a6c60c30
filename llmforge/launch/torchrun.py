"""torchrun for a plan: its command line (locally or across nodes), and its start.

Every rank runs ``llmforge.launch.worker`` with the saved ``plan.json``; the run itself
(torchrun's agent in this process, one report of a failed rank) is
``llmforge.processes.torchrun``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rich.console import Console

from llmforge.config.choices import Launcher
from llmforge.elastic import is_elastic
from llmforge.errors import Problem
from llmforge.estimate.core import Estimate, estimate_plan
from llmforge.estimate.shape import ranks_per_node
from llmforge.hardware import cpu_threads
from llmforge.plan import RunPlan
from llmforge.processes.dumps import flight_recorder_env
from llmforge.processes.hang import HangBounds
from llmforge.processes.nodes import NodeBoard
from llmforge.processes.torchrun import cluster_args, run_torchrun
from llmforge.processes.watch import HangWatch

WORKER = "llmforge.launch.worker"
RESTART_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def check_supported(plan: RunPlan) -> list[Problem]:
    """Launch settings a run needs (the layout's own rules, backend limits included, are
    the plan's: ``llmforge.layout``)."""
    out = []
    c = plan.config.cluster
    if c.nodes > 1 and c.launcher != Launcher.SLURM and not c.rdzv_endpoint:
        out.append(
            Problem(
                "cluster.rdzv_endpoint",
                None,
                "a multi-node run needs a rendezvous address every node can reach",
                "set cluster.rdzv_endpoint=HOST:PORT (the first node) or cluster.launcher=slurm",
            )
        )
    if plan.world_size % c.nodes:
        out.append(Problem("cluster.nodes", c.nodes, f"does not divide the world size {plan.world_size}", "set cluster.devices_per_node"))
    return out


def procs_per_node(plan: RunPlan) -> int:
    return ranks_per_node(plan)


def torchrun_args(plan: RunPlan, *, endpoint: str | None = None, run_id: str = "llmforge") -> list[str]:
    """torchrun options for this plan (same on every node); an elastic plan
    (``cluster.min_nodes``) runs on MIN:MAX nodes."""
    c = plan.config.cluster
    nodes = f"{c.min_nodes}:{c.nodes}" if is_elastic(plan.config) else str(c.nodes)
    args = cluster_args(
        nodes=nodes, per_node=procs_per_node(plan), endpoint=endpoint or c.rdzv_endpoint, max_restarts=c.max_restarts, run_id=run_id
    )
    return args + ([rendezvous_conf(c.elastic_wait_s)] if is_elastic(plan.config) and "--standalone" not in args else [])


def rendezvous_conf(wait_s: int) -> str:
    """The c10d rendezvous timing of an elastic run: wait ``wait_s`` for more nodes once the
    minimum is there; a node whose agent is silent for 3 keep-alives (about half of it) is dropped."""
    keep_alive = max(1, min(5, wait_s // 6))
    return f"--rdzv-conf=last_call_timeout={wait_s},keep_alive_interval={keep_alive},keep_alive_max_attempt=3"


def worker_args(*, plan_path: Path, resume_from: Path | None) -> list[str]:
    args = ["-m", WORKER, "--plan", str(plan_path)]
    return args + (["--resume", str(resume_from)] if resume_from is not None else [])


def torchrun_command(plan: RunPlan, *, plan_path: Path, resume_from: Path | None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(plan, run_id=plan.config.run.name),
        *worker_args(plan_path=plan_path, resume_from=resume_from),
    ]


def start(
    plan: RunPlan, *, plan_path: Path, resume_from: Path | None, dry_run: bool, console: Console, estimate: Estimate | None = None
) -> None:
    """Start torchrun for ``plan`` on this node (its plan.json already written), or with
    ``dry_run`` print the command. ``estimate``: the plan's (its step time bounds a hang)."""
    command = torchrun_command(plan, plan_path=plan_path, resume_from=resume_from)
    if dry_run:
        console.print(dry_run_text(command, plan_path=plan_path), highlight=False, soft_wrap=True, markup=False)
        return
    if plan.config.cluster.nodes > 1:
        console.print(f"start the same command on each of the {plan.config.cluster.nodes} nodes", highlight=False)
    step_s = (estimate if estimate is not None else estimate_plan(plan)).step_s
    run_torchrun(
        command[3:],
        console=console,
        threads=_threads(plan),
        hang_s=plan.config.cluster.timeout_s / 2,
        env={**restart_env(plan), **dump_env(plan)},
        watch=hang_watch(plan, step_s=step_s, console=console),
    )


def hang_watch(plan: RunPlan, *, step_s: float, console: Console) -> HangWatch:
    """How the launcher finds and explains a hang (``cluster.health``; ``step_s``: the estimated step time)."""
    c, h = plan.config.cluster, plan.config.cluster.health
    return HangWatch(
        bounds=HangBounds(step_s=step_s, factor=h.hang_factor, floor_s=h.hang_floor_s, long_s=h.hang_long_s),
        dump_root=plan.run_dir / "hangs",
        max_restarts=plan.config.cluster.max_restarts,
        say=lambda text: console.print(text, style="bold red", markup=False, highlight=False, soft_wrap=True),
        board=NodeBoard(endpoint=c.rdzv_endpoint, run_id=plan.config.run.name) if c.nodes > 1 and c.rdzv_endpoint else None,
    )


def dump_env(plan: RunPlan) -> dict[str, str]:
    """The flight recorder on every rank; on GPUs NCCL's own dump on a collective's timeout goes to run.dir/hangs/timeout/."""
    cuda = plan.config.cluster.accelerator != "cpu"
    timeout_dump = plan.run_dir / "hangs" / "timeout" / "rank_"
    if cuda:
        timeout_dump.parent.mkdir(parents=True, exist_ok=True)
    return flight_recorder_env(cuda=cuda, timeout_dump=timeout_dump)


def dry_run_text(command: list[str], *, plan_path: Path) -> str:
    """What ``--dry-run`` prints: the command, and the plan file it needs (not written)."""
    return (
        f"would write the plan to {plan_path} and run on every node:\n"
        + " ".join(shlex.quote(a) for a in command)
        + f"\n(--dry-run writes nothing; to run the command by hand, first write the plan with the same arguments: "
        f"llmforge plan ... --json > {shlex.quote(str(plan_path))})"
    )


def restart_env(plan: RunPlan) -> dict[str, str]:
    """With restarts, every attempt gets a fresh rendezvous store: on the agent's shared
    store (torch's default) a restarted group reads the failed attempt's keys and hangs."""
    return {RESTART_STORE_ENV: "1"} if plan.config.cluster.max_restarts > 0 else {}


def _threads(plan: RunPlan) -> int:
    return cpu_threads(procs_per_node(plan))
