"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model is cut into ``pp x virtual_stages`` chunks of consecutive blocks
(``plan.layers_per_stage``; the first chunk also embeds, the last also holds the
final norm and output layer). Each chunk is a GPT with the other blocks removed,
so parameter names are those of the full model. Which chunks a pipeline rank
runs is ``llmforge.layout.stage_ids``: chunk ``s`` on rank ``s % pp`` (looped
schedules) or, for the V-shaped ZBV schedule, on rank ``s`` for the first half
and ``2 pp - 1 - s`` for the second.
"""

from __future__ import annotations

from typing import Callable, List

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
from llmforge.layout import SINGLE_STAGE_SCHEDULES
from llmforge.models.gpt import GPT

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "zb_interleaved": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def stage_skeleton(config: ModelConfig, *, stage: int, layers_per_stage: List[int]) -> GPT:
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


def build_schedule(*, name: str, modules: List[nn.Module], ids: List[int], num_stages: int, group: dist.ProcessGroup, device: torch.device, microbatches: int, loss_fn: Callable):
    """The torch pipeline schedule over this rank's chunks."""
    stages = [PipelineStage(m, i, num_stages, device, group=group) for m, i in zip(modules, ids)]
    cls = SCHEDULES[name]
    if name in SINGLE_STAGE_SCHEDULES:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
