"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model is cut into ``pp x pp_virtual_stages`` chunks of consecutive blocks
(``plan.layers_per_stage``; the first chunk also embeds, the last also holds the
final norm and output layer). Each chunk is a GPT with the other blocks removed,
so parameter names are those of the full model. Which chunks a pipeline rank
runs is ``llmforge.layout.stage_ids``: chunk ``s`` on rank ``s % pp`` (looped
schedules) or, for the V-shaped ZBV schedule, on rank ``s`` for the first half
and ``2 pp - 1 - s`` for the second.

Every stage is given the shapes of what it receives and sends (``StageShapes``):
tokens ``[micro_batch, seq]`` into the first chunk, the residual stream
``[micro_batch, seq / tp under sequence parallel, hidden]`` between chunks. The
stages then skip torch's shape inference (a forward of every chunk on empty
tensors and an exchange of shapes with the neighbours before the first step), so
a rank can run its schedule without its neighbours' answers (``llmforge estimate
--rehearse`` runs one rank over a fake process group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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

from llmforge.config.choices import Schedule
from llmforge.config.schema import ModelConfig
from llmforge.layout import SINGLE_STAGE_SCHEDULES
from llmforge.models.gpt import GPT

SCHEDULES = {
    Schedule.GPIPE: ScheduleGPipe,
    Schedule.ONE_F_ONE_B: Schedule1F1B,
    Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    Schedule.LOOPED_BFS: ScheduleLoopedBFS,
    Schedule.ZB_INTERLEAVED: ScheduleInterleavedZeroBubble,
    Schedule.ZBV: ScheduleZBVZeroBubble,
}


def stage_skeleton(config: ModelConfig, *, stage: int, layers_per_stage: list[int]) -> GPT:
    """Chunk ``stage`` of the model on the meta device (no memory): the full model's
    parameter names, only the blocks, embedding and output layer this chunk holds.

    With tied embeddings the last chunk gets ``head``, a copy of the embedding
    table that ``TiedEmbeddingSync`` keeps equal to it (initialised as the embedding:
    ``tied_copy_source``)."""
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
        if last and not first and config.tie_embeddings:
            model.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return model


def tied_copy_source(config: ModelConfig, *, stage: int, num_stages: int) -> dict:
    """Parameter names of chunk ``stage`` whose initial value is another parameter's:
    the last chunk's copy of a tied embedding starts as the embedding."""
    if config.tie_embeddings and stage == num_stages - 1 and stage > 0:
        return {"head.weight": "embed.weight"}
    return {}


@dataclass(frozen=True)
class StageShapes:
    """What one microbatch carries into and out of the chunks."""

    micro_batch: int
    seq_len: int
    #: tokens of the residual stream a rank holds (seq_len / tp under sequence parallel)
    stream_tokens: int
    hidden: int
    stream_dtype: torch.dtype
    #: the output layer's columns on a rank (vocab / tp) and their dtype (the compute dtype)
    logits: int
    logits_dtype: torch.dtype

    def stream(self) -> torch.Tensor:
        return torch.empty(self.micro_batch, self.stream_tokens, self.hidden, dtype=self.stream_dtype, device="meta", requires_grad=True)

    def example_args(self, *, stage: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``stage``'s example input and output (meta tensors: shapes, strides, dtypes). The
        last chunk's output (the logits, a DTensor under tensor parallel) goes to the loss and is
        sent nowhere: its example only counts the outputs."""
        first, last = stage == 0, stage == num_stages - 1
        inputs = torch.empty(self.micro_batch, self.seq_len, dtype=torch.long, device="meta") if first else self.stream()
        outputs = (
            torch.empty(self.micro_batch, self.seq_len, self.logits, dtype=self.logits_dtype, device="meta") if last else self.stream()
        )
        return inputs, outputs


def _check_sent_activations(expected: torch.Tensor, stage: int):
    """A forward hook: what a chunk sends has the shape and dtype its neighbour was told."""

    def hook(_module: nn.Module, _args, output) -> None:
        if isinstance(output, torch.Tensor) and (output.shape != expected.shape or output.dtype != expected.dtype):
            raise RuntimeError(
                f"pipeline chunk {stage} sends {tuple(output.shape)} {output.dtype}, "
                f"its neighbour expects {tuple(expected.shape)} {expected.dtype} (llmforge.parallel.pipeline.StageShapes)"
            )

    return hook


def _stage(
    module: nn.Module, stage: int, num_stages: int, *, shapes: StageShapes, device: torch.device, group: dist.ProcessGroup
) -> PipelineStage:
    inputs, outputs = shapes.example_args(stage=stage, num_stages=num_stages)
    if stage < num_stages - 1:
        module.register_forward_hook(_check_sent_activations(outputs, stage))
    return PipelineStage(module, stage, num_stages, device, input_args=inputs, output_args=outputs, group=group)


def build_schedule(
    *,
    name: str,
    modules: list[nn.Module],
    ids: list[int],
    num_stages: int,
    group: dist.ProcessGroup,
    device: torch.device,
    microbatches: int,
    loss_fn: Callable,
    shapes: StageShapes,
):
    """The torch pipeline schedule over this rank's chunks, their shapes given (``shapes``)."""
    stages = [_stage(m, i, num_stages, shapes=shapes, device=device, group=group) for m, i in zip(modules, ids, strict=False)]
    cls = SCHEDULES[name]
    if name in SINGLE_STAGE_SCHEDULES:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
