"""Plan -> processes. A one-rank plan trains in this process (unless
``cluster.launcher=torchrun``); everything else goes through torchrun (see
llmforge.launch.torchrun)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from rich.console import Console

from llmforge.plan import RunPlan
from llmforge.rundir import RunLock, check_writable


def launch(plan: RunPlan, *, resume_from: Optional[Path], force: bool, dry_run: bool, console: Console, overwrite: bool = False) -> None:
    """Check, then run ``plan`` here or through torchrun, holding the run folder's lock."""
    if plan.config.logging.tensorboard:
        from llmforge.observe.tensorboard import check_installed

        check_installed()
    _preflight(plan, force=force, console=console)
    if resume_from is None and plan.config.model.init_from:
        from llmforge.checkpoint.hf_import import check_folder

        for note in check_folder(plan.config.model.init_from, plan.config.model):
            console.print(note, style="yellow", markup=False, highlight=False)
    launcher = plan.config.cluster.launcher
    here = plan.world_size == 1 and launcher == "local" and plan.config.cluster.max_restarts == 0
    if dry_run:
        if here:
            console.print(f"would train in this process: {plan.layout}, {plan.config.train.steps} steps into {plan.run_dir}", markup=False, highlight=False)
            return
        from llmforge.launch.torchrun import launch_distributed

        launch_distributed(plan, resume_from=resume_from, dry_run=True, console=console)
        return
    if launcher != "slurm":
        _check_devices(plan)
    for folder in (plan.run_dir, plan.run_dir / "checkpoints"):
        check_writable(folder, key="run.dir")
    if launcher != "slurm":
        _check_space(plan)
    with _lock(plan):
        if resume_from is None:
            _claim_run_dir(plan.run_dir, overwrite=overwrite, console=console)
        if here:
            _run_here(plan, resume_from=resume_from, console=console)
            return
        from llmforge.launch.torchrun import launch_distributed

        launch_distributed(plan, resume_from=resume_from, dry_run=False, console=console)


def _lock(plan: RunPlan):
    """The run folder's lock, taken here for a run on this machine. A multi-node run's
    rank 0 takes it after the rendezvous (every node's launcher shares the folder); a
    SLURM script only gets written."""
    c = plan.config.cluster
    if c.launcher != "slurm" and c.nodes == 1:
        return RunLock(plan.run_dir)
    return contextlib.nullcontext()


def _preflight(plan: RunPlan, *, force: bool, console: Console) -> None:
    """Show the short estimate; refuse a plan estimated not to fit unless forced."""
    from llmforge.errors import UserError, fail
    from llmforge.estimate.report import short_summary
    from llmforge.plan import tokenizer_problems

    problems = tokenizer_problems(plan.config)
    if problems:
        raise UserError(problems, title="the run plan is not valid")
    text, fits = short_summary(plan)
    console.print(text, markup=False, highlight=False)
    if not fits and not force:
        raise fail("the plan is estimated not to fit in device memory; change the layout (llmforge estimate --search) or pass --force")


#: Bytes a checkpoint holds per parameter: fp32 weights and AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAM = 12


def _check_space(plan: RunPlan) -> None:
    """Refuse a run whose first checkpoint cannot fit on run.dir's file system."""
    import shutil

    from llmforge.errors import Problem, UserError
    from llmforge.estimate.core import estimate_plan

    folder = plan.run_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    need = estimate_plan(plan).params_total * CHECKPOINT_BYTES_PER_PARAM
    free = shutil.disk_usage(folder).free
    if free < need:
        raise UserError([Problem("run.dir", str(plan.run_dir), f"a checkpoint of this model needs about {need / 2**30:.3g} GiB and the file system of {folder} has {free / 2**30:.3g} GiB free",
                                 "free space there or choose a run.dir on a larger file system")], title="not enough disk space")


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
        if any((run_dir / "checkpoints").glob("step_*/manifest.json")):
            raise fail(
                f"run.dir={run_dir} already holds a run ({names}); continue it with `llmforge resume ckpt={run_dir}`, "
                "choose another run.dir=..., or pass --overwrite to start over"
            )
        raise fail(
            f"run.dir={run_dir} holds an earlier run ({names}) that saved no complete checkpoint, so it cannot be resumed; "
            "pass --overwrite to start over there, or choose another run.dir=..."
        )
    for path in [*found, run_dir / "wandb_run_id"]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    console.print(f"--overwrite: removed the earlier run in {run_dir}", style="yellow", markup=False, highlight=False)


def _run_here(plan: RunPlan, *, resume_from: Optional[Path], console: Console) -> None:
    from llmforge.train.components import RankInfo
    from llmforge.train.run import run

    import torch

    device = torch.device("cpu") if plan.config.cluster.accelerator == "cpu" else torch.device("cuda", 0)
    summary = run(plan, rank=RankInfo(device=device), resume_from=resume_from, console=console)
    console.print(summary.describe(plan))
