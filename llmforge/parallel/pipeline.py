"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model is cut into ``pp x virtual_stages`` chunks of consecutive blocks
(``plan.layers_per_stage``; the first chunk also embeds, the last also holds the
final norm and output layer). Each chunk is a GPT with the other blocks removed,
so parameter names are those of the full model. Chunk ``s`` runs on pipeline
rank ``s % pp`` (looped schedules) or, for the V-shaped ZBV schedule, on rank
``s`` for the first half and ``2 pp - 1 - s`` for the second.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from llmforge.config.schema import ModelConfig
from llmforge.models.gpt import GPT, rope_tables
from llmforge.train.precision import DTYPES, LossScaler
from llmforge.train.step import StepOutput, eval_mode

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "zb_interleaved": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("gpipe", "1f1b")


def stage_ids(*, pp_rank: int, pp: int, virtual: int, schedule: str) -> List[int]:
    """The pipeline chunks this pipeline rank runs, in order."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def build_stage_model(config: ModelConfig, *, stage: int, layers_per_stage: List[int], seed: int, device: torch.device) -> GPT:
    """Chunk ``stage`` of the model, with exactly the initial weights it has in the full model.

    With tied embeddings the last chunk gets ``head``, a copy of the embedding
    table that ``TiedEmbeddingSync`` keeps equal to it."""
    with torch.device("meta"):
        model = GPT(config)
    start = sum(layers_per_stage[:stage])
    keep = {str(i) for i in range(start, start + layers_per_stage[stage])}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    first, last = stage == 0, stage == len(layers_per_stage) - 1
    if not first:
        model.embed, model.pos_embed = None, None
    if not last:
        model.norm, model.head = None, None
    tied_copy = last and not first and config.tie_embeddings
    if tied_copy:
        with torch.device("meta"):
            model.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    model.to_empty(device=device)
    if config.position == "rope":
        cos, sin = rope_tables(head_dim=config.hidden_size // config.num_heads, seq_len=config.seq_len, theta=config.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.init_weights(seed=seed)
    if tied_copy:
        _copy_embedding_init(model, seed=seed)
    return model


@torch.no_grad()
def _copy_embedding_init(model: GPT, *, seed: int) -> None:
    holder = nn.Module()
    holder.config = model.config
    holder.embed = nn.Embedding(model.config.vocab_size, model.config.hidden_size)
    GPT.init_weights(holder, seed=seed)  # type: ignore[arg-type]  # seeds by the name "embed.weight"
    model.head.weight.copy_(holder.embed.weight)  # type: ignore[union-attr]


def autocast_forward(module: nn.Module, *, param_dtype: str, device: torch.device) -> None:
    """Run ``module``'s forward under autocast (pipeline schedules call forward themselves)."""
    if param_dtype == "fp32":
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type=device.type, dtype=DTYPES[param_dtype]):
            return inner(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def build_schedule(*, name: str, modules: List[nn.Module], ids: List[int], num_stages: int, group: dist.ProcessGroup, device: torch.device, microbatches: int, loss_fn: Callable):
    """The torch pipeline schedule over this rank's chunks."""
    stages = [PipelineStage(m, i, num_stages, device, group=group) for m, i in zip(modules, ids)]
    cls = SCHEDULES[name]
    if name in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


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
    schedule.pipeline_order_with_comms = {rank: [a for a in actions if a.computation_type.value not in _BACKWARD_ACTIONS] for rank, actions in full.items()}
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
    finish: Optional[Callable[[], None]] = None
    modules: List[nn.Module] = field(default_factory=list)

    def scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.scaler.scaled(self.loss_fn(output, target))

    def __call__(self, batch: torch.Tensor) -> StepOutput:
        batch = batch.to(self.device, non_blocking=True)
        losses: List[torch.Tensor] = []
        args = (batch[:, :-1],) if self.has_first else ()
        kwargs: Dict[str, object] = {"target": batch[:, 1:], "losses": losses} if self.has_last else {}
        with self.context():
            self.schedule.step(*args, **kwargs)
        if self.finish is not None:
            self.finish()
        return StepOutput(loss=self._mean(losses))

    def evaluate(self, batch: torch.Tensor) -> float:
        """Forward only through the stages (the schedule's eval path): the mean loss."""
        batch = batch.to(self.device, non_blocking=True)
        losses: List[torch.Tensor] = []
        args = (batch[:, :-1],) if self.has_first else ()
        kwargs: Dict[str, object] = {"target": batch[:, 1:], "losses": losses} if self.has_last else {}
        with eval_mode(self.modules), self.context(), _forward_only_order(self.schedule):
            self.schedule.eval(*args, **kwargs)
        return self._mean(losses)

    def _mean(self, losses: List[torch.Tensor]) -> float:
        """The last stage's mean microbatch loss, sent to every stage and averaged over dp."""
        if self.has_last:
            local = torch.stack([x.detach().float() for x in losses]).mean() * self.scaler.unscale_factor()
        else:
            local = torch.zeros((), device=self.device)
        dist.all_reduce(local, group=self.pp_group)
        dist.all_reduce(local, group=self.dp_group)
        return float(local) / self.dp_size
