"""A one-rank run trained in this process, as ``llmforge pretrain`` does by default."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from llmforge.estimate.core import Estimate
from llmforge.hardware import cpu_threads
from llmforge.plan import RunPlan
from llmforge.train.components import RankInfo
from llmforge.train.run import run


def run_here(plan: RunPlan, *, resume_from: Path | None, console: Console, estimate: Estimate | None = None) -> None:
    """Train ``plan`` on this process's device (the first GPU, or the CPU for cluster=cpu);
    ``estimate``: the launcher's, shared with the meter and the closing line."""
    import torch

    device = local_device(plan)
    if device.type == "cpu":  # the threads its profile was measured with (llmforge calibrate sets the same)
        torch.set_num_threads(cpu_threads(1))
    summary = run(plan, rank=RankInfo(device=device), resume_from=resume_from, console=console, estimate=estimate)
    console.print(summary.describe(plan))


def local_device(plan: RunPlan):
    """The device a run in this process trains on: the first GPU, or the CPU for cluster=cpu."""
    import torch

    return torch.device("cpu") if plan.config.cluster.accelerator == "cpu" else torch.device("cuda", 0)
