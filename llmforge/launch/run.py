"""``launch(plan)``: check the plan and the machine, take the run folder, then train in
this process (one rank, ``cluster.launcher=local``), through torchrun
(``llmforge.launch.torchrun``), as a SLURM script (``llmforge.launch.slurm``) or as a
Kubernetes or SkyPilot job (``llmforge.launch.platform``).

plan.json is written by ``llmforge.rundir.write_plan`` alone: here before the ranks
start (they read it), and by the trainer once a run in this process is under way (a
run refused before it starts leaves no folder behind)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from rich.console import Console

from llmforge.config.choices import Launcher, Offload
from llmforge.config.launchers import PLATFORM_LAUNCHERS
from llmforge.data.prepare import document_ends_for
from llmforge.errors import UserError, fail, pasteable
from llmforge.estimate.core import Estimate, estimate_plan
from llmforge.launch import kubernetes, skypilot
from llmforge.launch.checks import check_devices, check_fault, check_host_memory, check_space, preflight
from llmforge.launch.local import run_here
from llmforge.launch.platform import check_platform, to_yaml
from llmforge.launch.slurm import submit_script
from llmforge.launch.torchrun import check_supported, start
from llmforge.plan import RunPlan
from llmforge.rundir import RunLock, check_writable, plan_path, write_plan
from llmforge.storage import check_reachable, is_url


def launch(
    plan: RunPlan,
    *,
    resume_from: Path | None,
    force: bool,
    dry_run: bool,
    console: Console,
    overwrite: bool = False,
    estimate: Estimate | None = None,
) -> None:
    """Check, then run ``plan`` here or through torchrun, holding the run folder's lock.
    (The first CPU run on a machine has measured it already: ``llmforge.commands.train``.)
    ``estimate``: the command's one estimate of ``plan``, which the checks, and a run in this
    process (its meter and closing line), share; None: estimated here, once."""
    if estimate is None:
        estimate = estimate_plan(plan, documents=document_ends_for(plan.config, vocab_size=plan.data_vocab_size))
    check_fault(plan, resume_from=resume_from, here=runs_here(plan), console=console)
    if plan.config.cluster.launcher in PLATFORM_LAUNCHERS:
        _launch_on_platform(plan, estimate, resume_from=resume_from, force=force, dry_run=dry_run, console=console)
        return
    preflight(plan, force=force, resume=resume_from is not None, console=console, estimate=estimate)
    here = runs_here(plan)
    if dry_run:
        if here:
            console.print(
                f"would train in this process: {plan.layout}, {plan.config.train.steps} steps into {plan.run_dir}",
                markup=False,
                highlight=False,
            )
            return
        launch_distributed(plan, resume_from=resume_from, dry_run=True, console=console)
        return
    launcher = plan.config.cluster.launcher
    if launcher != Launcher.SLURM:
        check_devices(plan)
    check_writable(plan.run_dir, key="run.dir")
    if is_url(plan.checkpoint_root):
        check_reachable(plan.checkpoint_root, key="checkpoint.dir")
    else:
        check_writable(plan.checkpoint_root, key="run.dir")
    if launcher != Launcher.SLURM and not is_url(plan.checkpoint_root):
        check_space(plan, estimate=estimate)
        check_host_memory(plan, estimate=estimate)
    with _lock(plan):
        if resume_from is None or not _holds(plan, resume_from):
            claim_run_dir(plan.run_dir, overwrite=overwrite, console=console)
        if here:
            run_here(plan, resume_from=resume_from, console=console, estimate=estimate)
            return
        launch_distributed(plan, resume_from=resume_from, dry_run=False, console=console)


def _launch_on_platform(
    plan: RunPlan, estimate: Estimate, *, resume_from: Path | None, force: bool, dry_run: bool, console: Console
) -> None:
    """Kubernetes or SkyPilot: check the plan, then print or submit its manifest; nothing is
    written here (run.dir is on the platform's storage)."""
    if resume_from is not None:
        raise fail(
            f"cluster.launcher={plan.config.cluster.launcher}: "
            "a job there always continues from the newest complete checkpoint in run.dir; "
            "submit it again with `llmforge pretrain` and the same run.dir instead of `llmforge resume`"
        )
    check_platform(plan)
    preflight(plan, force=force, resume=False, console=console, estimate=estimate)
    platform = kubernetes if plan.config.cluster.launcher == Launcher.KUBERNETES else skypilot
    manifest = platform.manifest(plan)
    if dry_run:  # the manifest alone on stdout (`> job.yaml`), the notes on the console
        print(to_yaml(manifest), end="", flush=True)
        console.print(f"(--dry-run submits nothing; {platform.SUBMIT_HINT})", markup=False, highlight=False, soft_wrap=True)
        return
    platform.submit(plan, manifest, console=console)


def _holds(plan: RunPlan, checkpoint: Any) -> bool:
    """Whether the checkpoint is one of this run's (a resume that continues that run; a
    resume into another folder starts one there, and takes that folder like ``pretrain``)."""
    if is_url(checkpoint):
        return is_url(plan.checkpoint_root) and checkpoint.startswith(str(plan.checkpoint_root) + "/")
    return Path(plan.run_dir).resolve() in Path(checkpoint).resolve().parents


def runs_here(plan: RunPlan) -> bool:
    """One rank, no restarts, no offloaded states (FSDP2's, which needs a process group) and
    ``cluster.launcher=local``: train in this process."""
    c = plan.config.cluster
    return plan.world_size == 1 and c.launcher == Launcher.LOCAL and c.max_restarts == 0 and plan.layout.offload == Offload.NONE


def launch_distributed(plan: RunPlan, *, resume_from: Path | None, dry_run: bool, console: Console) -> None:
    """Run ``plan`` on all its ranks (or write/print the SLURM script)."""
    problems = check_supported(plan)
    if problems:
        raise UserError(problems, title="this layout cannot be launched")
    if not dry_run:
        write_plan(plan)
    if plan.config.cluster.launcher == Launcher.SLURM:
        submit_script(plan, plan_path=plan_path(plan), resume_from=resume_from, dry_run=dry_run, console=console)
        return
    start(plan, plan_path=plan_path(plan), resume_from=resume_from, dry_run=dry_run, console=console)


def _lock(plan: RunPlan):
    """The run folder's lock, taken here for a run on this machine. A multi-node run's
    rank 0 takes it after the rendezvous (every node's launcher shares the folder); a
    SLURM script only gets written."""
    c = plan.config.cluster
    if c.launcher != Launcher.SLURM and c.nodes == 1:
        return RunLock(plan.run_dir)
    return contextlib.nullcontext()


#: What a run that has trained leaves in its folder. plan.json is not among them: on a
#: shared file system every node of a multi-node launch writes it before training starts.
RUN_FILES = ("metrics.jsonl", "checkpoints")


def claim_run_dir(run_dir: Path, *, overwrite: bool, console: Console) -> None:
    """A new run (or a resume into another folder) never mixes its metrics and checkpoints
    with an earlier run's."""
    import shutil

    found = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not found:
        return
    if not overwrite:
        names = ", ".join(p.name for p in found)
        if any((run_dir / "checkpoints").glob("step_*/manifest.json")):
            raise fail(
                f"run.dir={run_dir} already holds a run ({names}); "
                f"continue it with `llmforge resume {pasteable('ckpt', run_dir, override=False)}`, "
                "choose another run.dir=..., or pass --overwrite to start over"
            )
        raise fail(
            f"run.dir={run_dir} holds an earlier run ({names}) that saved no complete checkpoint, so it cannot be resumed; "
            "pass --overwrite to start over there, or choose another run.dir=..."
        )
    for path in [*found, run_dir / "wandb_run_id", run_dir / "evals"]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    console.print(f"--overwrite: removed the earlier run in {run_dir}", style="yellow", markup=False, highlight=False)
