"""The step seam under pipeline parallelism: one ``torch.distributed.pipelining``
schedule run over the step's microbatches (``llmforge.parallel.pipeline`` builds
the chunks and the schedule)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

from llmforge.config.choices import Dtype
from llmforge.train.precision import DTYPES, LossScaler
from llmforge.train.step import StepOutput, eval_mode, to_device


def autocast_forward(module: nn.Module, *, param_dtype: str, device: torch.device) -> None:
    """Run ``module``'s forward under autocast (pipeline schedules call forward themselves)."""
    if param_dtype == Dtype.FP32:
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type=device.type, dtype=DTYPES[param_dtype]):
            return inner(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


@functools.cache
def _takes_return_outputs(schedule_type: type) -> bool:
    return "return_outputs" in inspect.signature(schedule_type.step).parameters


def _no_outputs(schedule) -> dict[str, bool]:
    """``return_outputs=False`` where the schedule takes it (torch 2.7 and later): the last
    stage then keeps no microbatch's logits after its loss (they would wait, every microbatch's,
    for the next step to clear them), as the loss is all the step returns."""
    return {"return_outputs": False} if _takes_return_outputs(type(schedule)) else {}


_BACKWARD_ACTIONS = {"B", "I", "W", "SEND_B", "RECV_B", "REDUCE_GRAD"}


@contextlib.contextmanager
def _forward_only_order(schedule) -> Iterator[None]:
    """The V-shaped ZBV schedule hands gradients between its two local stages even in
    ``eval()`` (torch 2.13 then fails: the stages have no backward); run its actions
    without the backward ones and their transfers instead (forward order unchanged)."""
    if not isinstance(schedule, ScheduleZBVZeroBubble):
        yield
        return
    full = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if a.computation_type.value not in _BACKWARD_ACTIONS] for rank, actions in full.items()
    }
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = full


@dataclass
class PipelineStep:
    """The step seam under pipeline parallelism: one schedule run over the step's
    microbatches. The mean loss is sent from the last stage to every rank and
    averaged over data-parallel ranks; ``finish`` runs after backward."""

    schedule: object
    has_first: bool
    has_last: bool
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scaler: LossScaler
    device: torch.device
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    dp_size: int
    context: Callable = field(default=lambda: torch.enable_grad())
    finish: Callable[[], None] | None = None
    modules: list[nn.Module] = field(default_factory=list)
    documents_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scaler.scaled(self.loss_fn(output, target))

    def __call__(self, batch: torch.Tensor) -> StepOutput:
        batch = to_device(batch, self.device)
        losses: list[torch.Tensor] = []
        args, kwargs = self._inputs(batch, losses)
        with self.context():
            self.schedule.step(*args, **kwargs, **_no_outputs(self.schedule))
        if self.finish is not None:
            self.finish()
        return StepOutput(loss=self._mean(losses))

    def evaluate(self, batch: torch.Tensor) -> float:
        """Forward only through the stages (the schedule's eval path): the mean loss."""
        batch = to_device(batch, self.device)
        losses: list[torch.Tensor] = []
        args, kwargs = self._inputs(batch, losses)
        with eval_mode(self.modules), self.context(), _forward_only_order(self.schedule):
            self.schedule.eval(*args, **kwargs)
        return float(self._mean(losses))

    def _inputs(self, batch: torch.Tensor, losses: list[torch.Tensor]) -> tuple[tuple, dict[str, object]]:
        """The schedule's arguments: the tokens for the first stage, targets for the last, and
        ``documents`` for every stage (the schedule splits them into microbatches as the tokens)."""
        args = (batch[:, :-1],) if self.has_first else ()
        kwargs: dict[str, object] = {"target": batch[:, 1:], "losses": losses} if self.has_last else {}
        documents = self.documents_of(batch[:, :-1]) if self.documents_of is not None else None
        if documents is not None:
            kwargs["documents"] = documents
        return args, kwargs

    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean microbatch loss, sent to every stage and averaged over dp
        (a device tensor: reading it is the caller's choice)."""
        if self.has_last:
            local = torch.stack([x.detach().float() for x in losses]).mean() * self.scaler.unscale_factor()
        else:
            local = torch.zeros((), device=self.device)
        dist.all_reduce(local, group=self.pp_group)
        dist.all_reduce(local, group=self.dp_group)
        return local / self.dp_size
