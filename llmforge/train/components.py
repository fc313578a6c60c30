"""What the training loop works with, already built: it parses no config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from llmforge.train.precision import LossScaler
from llmforge.train.step import StepRunner


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: The run's ``llmforge.parallel.mesh.ParallelMesh`` (None in a single process).
    mesh: Optional[Any] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def clip_local(parameters: List[nn.Parameter], max_norm: float) -> float:
    """Global gradient norm (clipped to max_norm when it is positive) in one process."""
    grads = [p for p in parameters if p.grad is not None]
    limit = max_norm if max_norm > 0 else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(grads, limit, foreach=False))


@dataclass
class Components:
    """The built parts of a run on one rank.

    ``model_parts`` holds the model, or this rank's pipeline chunks.
    ``clip_grads(max_norm)`` returns the gradient norm over every parallel
    dimension and clips to it."""

    model_parts: List[nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: object
    step: StepRunner
    scaler: LossScaler
    clip_grads: Callable[[float], float]
    rank: RankInfo
    tokens_per_step: int
    extra_metrics: Callable[[], dict] = field(default=lambda: {})
    #: The held-out stream (``split="val"``), or None when the run does not validate.
    val_sampler: Optional[object] = None

    def parameters(self) -> List[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
