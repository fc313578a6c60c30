"""What the training loop works with, already built: it parses no config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from llmforge.train.anomaly import StepGuard
from llmforge.train.callbacks import Callback
from llmforge.train.guarded_step import GuardedOptimizerStep
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
    mesh: Any | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Components:
    """The built parts of a run on one rank, built once (``llmforge.train.build``) and never changed.

    ``model_parts`` holds the model, or this rank's pipeline chunks.
    ``clip_grads(max_norm, flags=...)`` returns the gradient norm over every parallel
    dimension (a device tensor) and clips to it; ``guard`` judges each step (non-finite
    numbers, spikes: ``llmforge.train.anomaly``) and ``update`` steps the optimizer as its
    verdict allows (``llmforge.train.guarded_step``)."""

    model_parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: Any
    step: StepRunner
    scaler: LossScaler
    clip_grads: Callable[..., torch.Tensor]
    rank: RankInfo
    tokens_per_step: int
    guard: StepGuard
    update: GuardedOptimizerStep
    extra_metrics: Callable[[], dict] = field(default=lambda: {})
    #: Measured MFU and peak memory for a step time (``llmforge.train.meter``).
    meter: Callable[[float], dict] | None = None
    #: The held-out stream (``split="val"``), or None when the run does not validate.
    val_sampler: Any | None = None
    #: With a data.mixture: (dataset name, a held-out sampler of that dataset alone) for each, read from its start at every validation.
    val_sources: tuple[tuple[str, Any], ...] = ()
    #: Run before each step with its number (1-based): QAT switched on from a step (``llmforge.parallel.qat.switch_at``).
    before_step: Callable[[int], None] = field(default=lambda step: None)
    #: What the model needs after every optimizer step (the MoE bias, float8 scales: ``llmforge.train.model_updates``).
    callbacks: tuple[Callback, ...] = ()

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters() if p.requires_grad]

    def stateful_parts(self) -> dict[str, Stateful]:
        """The components whose state ``train_state.json`` keeps, by the key it has there."""
        parts: dict[str, Stateful] = {"scheduler": self.scheduler, "sampler": self.sampler, "scaler": self.scaler, "anomaly": self.guard}
        if self.val_sampler is not None:
            parts["val_sampler"] = self.val_sampler
        return parts

    def host_tensors(self) -> list[torch.Tensor]:
        """Tensors read every step that live in host memory in a GPU run too, so reading them
        waits for no device: the for-loop AdamW's step counters, the guard's flag where the
        optimizer decides on the host (``llmforge.train.syncs`` does not count them)."""
        steps = [s["step"] for s in self.optimizer.state.values() if "step" in s]
        return steps + self.update.host_tensors()
