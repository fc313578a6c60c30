"""Plan -> processes. One rank on a CPU runs in this process; everything else
goes through torchrun (see llmforge.parallel.launcher)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.console import Console

from llmforge.plan import RunPlan


def launch(plan: RunPlan, *, resume_from: Optional[Path], force: bool, dry_run: bool, console: Console) -> None:
    _preflight(plan, force=force, console=console)
    if plan.world_size == 1 and plan.config.cluster.launcher == "local":
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


def _run_here(plan: RunPlan, *, resume_from: Optional[Path], console: Console) -> None:
    from llmforge.train.components import RankInfo
    from llmforge.train.run import run

    summary = run(plan, rank=RankInfo(), resume_from=resume_from, console=console)
    losses = f"loss {summary.first_loss:.4f} -> {summary.last_loss:.4f} " if summary.first_loss is not None else "no steps left to train "
    console.print(
        f"[bold green]done[/] step {summary.last_step}: {losses}"
        f"in {summary.wall_s:.1f}s; metrics in {plan.run_dir / 'metrics.jsonl'}"
        + (f"; checkpoint {summary.checkpoint}" if summary.checkpoint else "")
    )
