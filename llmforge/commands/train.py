"""``llmforge pretrain`` and ``resume``: a plan handed to ``llmforge.launch``, after the first
CPU run on a machine has measured it (``llmforge.calibrate.auto``; not for ``--dry-run``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from llmforge.commands.plans import build_plan, check_fp8_pays, plan_estimate
from llmforge.plan import RunPlan


def pretrain_command(
    overrides: Sequence[str], *, config_dir: Sequence[Path], force: bool, dry_run: bool, overwrite: bool, console: Console
) -> None:
    run_plan = build_plan(overrides, config_dir=config_dir)
    check_eval_tasks(run_plan)
    from llmforge.commands.rehearsal import rehearse_before_launch
    from llmforge.launch import launch

    _calibrate_cpu(run_plan, dry_run=dry_run, console=console)  # (CPU plans; the rehearsal is for GPU ones)
    estimate = plan_estimate(run_plan)  # the one estimate of the run: after the calibration, whose profile it reads
    check_fp8_pays(run_plan, estimate, force=force)
    rehearse_before_launch(run_plan, estimate, force=force, console=console)
    launch(run_plan, resume_from=None, force=force, dry_run=dry_run, console=console, overwrite=overwrite, estimate=estimate)


def resume_command(
    overrides: Sequence[str],
    *,
    config_dir: Sequence[Path],
    force: bool,
    dry_run: bool,
    overwrite: bool,
    from_other_run: bool,
    console: Console,
) -> None:
    from llmforge.checkpoint.resume import plan_for_resume
    from llmforge.launch import launch

    run_plan, checkpoint = plan_for_resume(list(overrides), from_other_run=from_other_run, config_dir=config_dir)
    check_eval_tasks(run_plan)
    _calibrate_cpu(run_plan, dry_run=dry_run, console=console)
    estimate = plan_estimate(run_plan)
    check_fp8_pays(run_plan, estimate, force=force)
    launch(run_plan, resume_from=checkpoint, force=force, dry_run=dry_run, console=console, overwrite=overwrite, estimate=estimate)


def _calibrate_cpu(run_plan: RunPlan, *, dry_run: bool, console: Console) -> None:
    """The first CPU run on a machine measures it before the launcher's checks read its profile."""
    if not dry_run:
        from llmforge.calibrate.auto import ensure_cpu_profile

        ensure_cpu_profile(run_plan, console=console)


def check_eval_tasks(run_plan: RunPlan) -> None:
    """Before launch: the tasks of evaluations in the loop exist and their data loads (``llmforge.evaluate.tasks``)."""
    e = run_plan.config.eval
    if e.interval > 0 and e.tasks:
        from llmforge.evaluate.tasks import load_tasks

        load_tasks(e)
