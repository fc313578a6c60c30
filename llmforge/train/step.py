"""The training-step seam: forward and backward over one step's microbatches.

A step runner takes this data-parallel rank's share of the global batch
(``[rows, seq_len + 1]`` token ids) and leaves gradients of the mean loss over the
global batch in the parameters. It returns the mean loss as a 0-dim device
tensor, so a step never waits for the device; the loop reads it when it logs. In one
process (and under data/tensor parallelism) it is a gradient-accumulation loop;
under pipeline parallelism a ``torch.distributed.pipelining`` schedule replaces
it. Clipping, the optimizer step, logging and checkpoints do not care which ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from llmforge.processes.progress import mark
from llmforge.train.loss import cross_entropy
from llmforge.train.precision import LossScaler, autocast

__all__ = ["GradAccumulationStep", "StepOutput", "StepRunner", "cross_entropy", "to_device"]


@dataclass
class StepOutput:
    """``loss``: the step's mean loss, a detached 0-dim tensor on the device."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host batch to ``device`` without waiting for the device: a copy from
    pageable memory would first wait for the queued work, one from pinned memory
    does not."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


class StepRunner(Protocol):
    def __call__(self, batch: torch.Tensor) -> StepOutput: ...

    def evaluate(self, batch: torch.Tensor) -> float:
        """Mean loss over the global batch, forward only (eval mode, no gradients)."""
        ...


@contextlib.contextmanager
def eval_mode(modules) -> Iterator[None]:
    """Modules in eval mode (no dropout, no router statistics) and no autograd, then back."""
    was = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in zip(modules, was, strict=False):
            m.train(training)


@dataclass
class GradAccumulationStep:
    """Split the rank's rows into microbatches, accumulate gradients, average the loss.

    ``no_sync`` (optional) returns a context that suspends gradient reduction for
    all but the last microbatch; ``reduce_loss`` averages the logged loss across
    ranks that saw different data; ``loss_context`` wraps each microbatch's forward,
    loss and backward (tensor parallelism computes the loss on sharded logits in
    it); ``finish`` runs once after the last backward (gradient reductions);
    ``positions`` (context parallelism) are the global positions of this rank's
    slice of each sequence: inputs and targets are taken at them after the
    next-token shift and the model is told them; ``documents_of`` (document or
    sliding-window attention) gives the model's ``documents`` of the whole inputs."""

    model: nn.Module
    micro_batch_size: int
    param_dtype: str
    scaler: LossScaler
    device: torch.device
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    no_sync: Callable[[bool], contextlib.AbstractContextManager] | None = None
    reduce_loss: Callable[[torch.Tensor], torch.Tensor] | None = None
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    finish: Callable[[], None] | None = None
    positions: torch.Tensor | None = None
    documents_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def __call__(self, batch: torch.Tensor) -> StepOutput:
        micro = to_device(batch, self.device).split(self.micro_batch_size)
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            sync = self.no_sync(last) if self.no_sync is not None else contextlib.nullcontext()
            with sync, self.loss_context():
                mark("forward", microbatch=i)
                inputs, targets, extra = self._split(mb)
                with autocast(param_dtype=self.param_dtype, device=self.device):
                    logits = self.model(inputs, **extra)
                loss = self.loss_fn(logits, targets)
                mark("backward", microbatch=i)
                self.scaler.scaled(loss / len(micro)).backward()
            total += loss.detach()
        mark("comm")
        if self.finish is not None:
            self.finish()
        mean = total / len(micro)
        if self.reduce_loss is not None:
            mean = self.reduce_loss(mean)
        return StepOutput(loss=mean.detach())

    def evaluate(self, batch: torch.Tensor) -> float:
        micro = to_device(batch, self.device).split(self.micro_batch_size)
        total = torch.zeros((), device=self.device)
        with eval_mode([self.model]):
            for mb in micro:
                with self.loss_context():
                    inputs, targets, extra = self._split(mb)
                    with autocast(param_dtype=self.param_dtype, device=self.device):
                        logits = self.model(inputs, **extra)
                    total += self.loss_fn(logits, targets).detach().float()
        mean = total / len(micro)
        if self.reduce_loss is not None:
            mean = self.reduce_loss(mean)
        return float(mean)

    def _split(self, mb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Inputs and next-token targets of a microbatch (this rank's positions only), and
        the model's other arguments (``positions``, ``documents``)."""
        inputs, targets = mb[:, :-1], mb[:, 1:]
        extra: dict[str, torch.Tensor] = {}
        documents = self.documents_of(inputs) if self.documents_of is not None else None
        if documents is not None:
            extra["documents"] = documents
        if self.positions is None:
            return inputs, targets, extra
        index = self.positions.to(mb.device)
        extra["positions"] = index
        return inputs.index_select(1, index), targets.index_select(1, index), extra
