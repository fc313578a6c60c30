"""Give a model built on the meta device its memory and values, this rank's shards only.

A rank builds its model (or pipeline chunks) on the meta device, where nothing is
allocated, and applies every parallel transform there: the parameters become DTensors
that know their mesh and placements, or stay plain tensors where nothing shards them.
``materialize`` then allocates only what this rank holds (``to_empty``) and fills it
one parameter at a time from a source of whole values: the seeded initialisation, or
a Hugging Face folder. Each whole value lives on the host only while this rank's block
is cut from it (a view: every rank holds the same whole value, so no collective is
needed), so a rank's peak during the build is its shards plus the largest single parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import _disable_current_modes

from llmforge.models.gpt import GPT, initial_value

#: The whole value of a parameter, by its name in the full model and its global shape.
WholeValue = Callable[[str, torch.Size], torch.Tensor]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def model_name(name: str) -> str:
    """A parameter's name in the plain model, without the prefixes wrappers (recompute,
    compile) insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def seeded_values(model: GPT, *, seed: int, aliases: Mapping[str, str] | None = None) -> WholeValue:
    """The seeded initial values of ``model``'s parameters (``llmforge.models.gpt.initial_value``);
    ``aliases`` maps a parameter to the one whose initial value it copies."""
    aliases = aliases or {}
    return lambda name, shape: initial_value(model.config, name=aliases.get(name, name), shape=shape, seed=seed)


@torch.no_grad()
def materialize(model: GPT, *, device: torch.device, values: WholeValue, param_device: torch.device | None = None) -> None:
    """Allocate ``model``'s local shards (on ``param_device``, default ``device``; the
    host for offloaded states) and buffers (on ``device``), and fill them from ``values``."""
    model.to_empty(device=param_device or device)
    fill(model, values=values)
    model.init_buffers(device=device)


@torch.no_grad()
def fill(model: nn.Module, *, values: WholeValue) -> None:
    """Copy this rank's slice of each parameter's whole value into it, one parameter at a time."""
    for name, param in model.named_parameters():
        whole = values(model_name(name), param.shape)
        copy_slice(param, whole)
        del whole


def copy_slice(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Write the part of ``whole`` (the unsharded value) that ``param`` holds on this rank."""
    if isinstance(param, DTensor):
        local = param.to_local()
        local.copy_(local_piece(param, whole.to(device=local.device, dtype=local.dtype)))
    else:
        param.copy_(whole.to(dtype=param.dtype))


def local_piece(param: DTensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``whole``, a view where the shard is one block (as checkpoints
    read it). ``distribute_tensor`` cuts every rank's piece, and under FSDP over TP on one
    dimension (``_StridedShard``) concatenates each: a second whole copy at the build's peak."""
    with _disable_current_modes():  # index arithmetic on real tensors, outside a rehearsal's modes
        shape, offset = compute_local_shape_and_global_offset(whole.shape, param.device_mesh, param.placements)
    piece = whole[tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=False))]
    if piece.shape == param.to_local().shape:
        return piece
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
