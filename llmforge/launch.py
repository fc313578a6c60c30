"""Plan -> processes. A one-rank plan trains in this process (unless
``cluster.launcher=torchrun``); everything else goes through torchrun (see
llmforge.parallel.launcher)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.console import Console

from llmforge.plan import RunPlan


def launch(plan: RunPlan, *, resume_from: Optional[Path], force: bool, dry_run: bool, console: Console, overwrite: bool = False) -> None:
    if plan.config.logging.tensorboard:
        from llmforge.observe.tensorboard import check_installed

        check_installed()
    _preflight(plan, force=force, console=console)
    launcher = plan.config.cluster.launcher
    if launcher != "slurm" and not dry_run:
        _check_devices(plan)
    if resume_from is None and not dry_run:
        _claim_run_dir(plan.run_dir, overwrite=overwrite, console=console)
    if plan.world_size == 1 and launcher == "local" and plan.config.cluster.max_restarts == 0:
        if dry_run:
            console.print(f"would train in this process: {plan.layout}, {plan.config.train.steps} steps into {plan.run_dir}")
            return
        _run_here(plan, resume_from=resume_from, console=console)
        return
    from llmforge.parallel.launcher import launch_distributed

    launch_distributed(plan, resume_from=resume_from, dry_run=dry_run, console=console)


def _preflight(plan: RunPlan, *, force: bool, console: Console) -> None:
    """Show the short estimate; refuse a plan estimated not to fit unless forced."""
    from llmforge.errors import fail
    from llmforge.estimate.report import short_summary

    text, fits = short_summary(plan)
    console.print(text)
    if not fits and not force:
        raise fail("the plan is estimated not to fit in device memory; change the layout (llmforge estimate --search) or pass --force")


def _check_devices(plan: RunPlan) -> None:
    """A GPU profile needs as many CUDA devices on this node as ranks it starts here."""
    from llmforge.errors import Problem, UserError

    c = plan.config.cluster
    if c.accelerator == "cpu":
        return
    import torch

    wanted = c.devices_per_node or plan.world_size // c.nodes
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < wanted:
        raise UserError([Problem(
            "cluster.accelerator", c.accelerator,
            f"the plan starts {wanted} GPU rank(s) on this node, and this machine has {found} CUDA device(s)",
            "run it on the GPU nodes (or write a SLURM script with cluster.launcher=slurm), "
            "or train on this machine's CPU with cluster=cpu and a layout that fits it",
        )], title="this machine cannot run the plan")


#: What a run that has trained leaves in its folder. plan.json is not among them: on a
#: shared file system every node of a multi-node launch writes it before training starts.
RUN_FILES = ("metrics.jsonl", "checkpoints")


def _claim_run_dir(run_dir: Path, *, overwrite: bool, console: Console) -> None:
    """A new run never mixes its metrics and checkpoints with an earlier run's."""
    import shutil

    from llmforge.errors import fail

    found = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not found:
        return
    if not overwrite:
        names = ", ".join(p.name for p in found)
        raise fail(
            f"run.dir={run_dir} already holds a run ({names}); continue it with `llmforge resume ckpt={run_dir}`, "
            "choose another run.dir=..., or pass --overwrite to start over"
        )
    for path in [*found, run_dir / "wandb_run_id"]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    console.print(f"[yellow]--overwrite: removed the earlier run in {run_dir}[/]")


def _run_here(plan: RunPlan, *, resume_from: Optional[Path], console: Console) -> None:
    from llmforge.train.components import RankInfo
    from llmforge.train.run import run

    import torch

    device = torch.device("cpu") if plan.config.cluster.accelerator == "cpu" else torch.device("cuda", 0)
    summary = run(plan, rank=RankInfo(device=device), resume_from=resume_from, console=console)
    console.print(summary.describe(plan))
