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
from llmforge.models.layers import rope_tables

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "zb_interleaved": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


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


def build_schedule(*, name: str, modules: List[nn.Module], ids: List[int], num_stages: int, group: dist.ProcessGroup, device: torch.device, microbatches: int, loss_fn: Callable):
    """The torch pipeline schedule over this rank's chunks."""
    stages = [PipelineStage(m, i, num_stages, device, group=group) for m, i in zip(modules, ids)]
    cls = SCHEDULES[name]
    if name in SINGLE_STAGE_SCHEDULES:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
