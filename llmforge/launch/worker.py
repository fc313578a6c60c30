"""The program torchrun starts on every rank: join the group, build the mesh, run.

    python -m torch.distributed.run ... -m llmforge.launch.worker --plan RUN/plan.json [--resume CKPT] [--resume-newest]

Before anything is built, a multi-node run times its network (``llmforge.launch.netcheck``) and
every rank its device (``llmforge.launch.devicecheck``, on accelerators).
Rank 0 alone prints and logs. When torchrun restarts the ranks after a failure
(``cluster.max_restarts``), they continue from the run's newest complete checkpoint. An error
on a rank ends it with one record (``llmforge.processes.rank_errors``).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

from llmforge.checkpoint.locate import newest_complete
from llmforge.checkpoint.resume import saved_plan
from llmforge.elastic import describe_change
from llmforge.errors import UserError
from llmforge.launch.devicecheck import check_accelerators
from llmforge.launch.guard import install_from_env
from llmforge.launch.netcheck import check_network
from llmforge.parallel.mesh import init_distributed
from llmforge.plan import RunPlan, config_from_dict
from llmforge.processes.rank_errors import attempt, end_rank, env_rank, report_errors
from llmforge.processes.watch import guard_rank
from llmforge.rundir import RunLock
from llmforge.storage import is_url
from llmforge.train.build import distributed_rank
from llmforge.train.run import prepare_data, run, with_most_loaded_peak


def restart_point(plan, *, resume: Path | None, console, launched=None) -> Path | None:
    """Where a restarted attempt continues: the run's newest complete checkpoint (chosen by
    rank 0 for every rank), else where the first attempt started. Collective. Rank 0's
    first line names it, and, when the world changed (an elastic run, ``launched`` its
    plan as launched), the layouts before and after."""
    import torch.distributed as dist

    if attempt() == 0 and (launched is None or launched.world_size == plan.world_size):
        return resume
    found: list[str | None] = [None]
    if dist.get_rank() == 0:
        found[0] = _newest_complete_or_none(plan) if attempt() > 0 else None
        where = (
            f"resuming from {found[0]}"
            if found[0]
            else (f"starting again from {resume}" if resume else "starting over (no checkpoint yet)")
        )
        console.print(_restart_line(plan, launched=launched, checkpoint=found[0], where=where), highlight=False)
    dist.broadcast_object_list(found, src=0)
    return _where(found[0]) if found[0] else resume


def _newest_complete_or_none(plan) -> str | None:
    """The run's newest complete checkpoint, or None when it has none yet."""
    try:
        return str(newest_complete(plan.checkpoint_root).path)
    except UserError:
        return None


def _restart_line(plan, *, launched, checkpoint: str | None, where: str):
    from rich.text import Text

    head = f"restart {attempt()} of {plan.config.cluster.max_restarts}" if attempt() else "elastic start"
    if launched is None or launched.world_size == plan.world_size and _saved_world(checkpoint) in (None, plan.world_size):
        return Text.assemble((head, "bold yellow"), f" after a failed rank: {where}")
    before = _saved_plan(checkpoint) or launched
    return Text.assemble((head, "bold yellow"), f": {describe_change(before, plan, start=attempt() == 0)}; {where}")


def _saved_plan(checkpoint: str | None):
    """The plan a checkpoint was written under (at the world it ran on), or None."""
    if checkpoint is None:
        return None
    try:
        data = saved_plan(_where(checkpoint))
        return RunPlan.build(config_from_dict(data["config"]), world=int(data["derived"]["world_size"]))
    except Exception:  # noqa: BLE001 - an unreadable old plan only loses the "before" half of the line
        return None


def _where(text: str) -> Any:
    """A checkpoint location from text: an object-storage URL stays a string."""
    return text if is_url(text) else Path(text)


def _saved_world(checkpoint: str | None) -> int | None:
    saved = _saved_plan(checkpoint)
    return None if saved is None else saved.world_size


def newest_checkpoint(plan, *, console) -> Path | None:
    """The newest complete checkpoint of the run (rank 0 looks, for every rank), or None: where a
    platform's job starts (``--resume-newest``), so that one it restarts continues the run. Collective."""
    import torch.distributed as dist

    found: list[str | None] = [None]
    if dist.get_rank() == 0:
        found[0] = _newest_complete_or_none(plan)
        if found[0]:
            console.print(f"resuming from {found[0]}, the run's newest complete checkpoint", highlight=False)
    dist.broadcast_object_list(found, src=0)
    return _where(found[0]) if found[0] else None


def run_rank(*, plan_path: Path, resume: Path | None, resume_newest: bool = False) -> None:
    import torch.distributed as dist
    from rich.console import Console

    launched = RunPlan.load(plan_path)
    device = init_distributed(accelerator=launched.config.cluster.accelerator, timeout_s=launched.config.cluster.timeout_s)
    install_from_env(device)
    plan = launched.at_world(dist.get_world_size())  # an elastic run on fewer nodes: the layout for the world it got
    main = dist.get_rank() == 0
    if main and plan.config.cluster.nodes > 1:
        RunLock(plan.run_dir).acquire()  # held until this process ends; each node's launcher shares the folder
    console = Console(stderr=True, markup=False, soft_wrap=True) if main else Console(file=io.StringIO(), quiet=True)
    check_network(plan, device=device, console=console)
    check_accelerators(plan, device=device, console=console)
    if resume_newest and resume is None and attempt() == 0:
        resume = newest_checkpoint(plan, console=console)
    rank = distributed_rank(plan, device=device)
    resume = restart_point(plan, resume=resume, console=console, launched=launched)
    if main:
        prepare_data(plan, console=console)  # fills the shared cache before the others read it
    dist.barrier()
    # a platform's job may be a restart of itself: metrics past its starting step are dropped
    summary = run(plan, rank=rank, resume_from=resume, console=console, restarted=attempt() > 0 or resume_newest)
    summary = with_most_loaded_peak(summary, device=device)
    if main:
        console.print(summary.describe(plan))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmforge.launch.worker")
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--resume", type=_where, default=None)
    parser.add_argument("--resume-newest", action="store_true", help="continue from run.dir's newest complete checkpoint when there is one")
    args = parser.parse_args(argv)
    guard_rank(env_rank())
    with report_errors():
        run_rank(plan_path=args.plan, resume=args.resume, resume_newest=args.resume_newest)
    end_rank()


if __name__ == "__main__":
    main()
