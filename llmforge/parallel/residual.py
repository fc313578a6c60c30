"""The dtype of the residual stream under 16-bit compute (bf16 or fp16).

The residual stream is what flows between blocks: the embedding output, each
block's input and output (the input is what full recompute keeps) and the
activations pipeline stages send each other. By default it is in the compute
dtype, as torchtitan and Megatron run it; it can be kept in fp32 instead, like
Megatron's ``--fp32-residual-connection``. Master weights stay fp32 either way.

Where the compute copies of the weights come from decides where the stream
starts in the compute dtype:

- FSDP2 (ZeRO 1-3) gathers the weights in the compute dtype
  (``MixedPrecisionPolicy``), so the embedding lookups already return it;
- elsewhere (ZeRO 0, one process) autocast casts the fp32 weights for each
  matmul and leaves the embedding lookups in fp32: ``apply_residual_dtype``
  casts their outputs.

Either way the norms return their input's dtype (``llmforge.models.layers``), the
matmuls return the compute dtype, so the residual adds stay in the dtype the
stream started in. Each block's input is cast as well: a pipeline stage's
received activations, and anything that arrives in another dtype, enter the
blocks in the stream's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def _cast_output(_module: nn.Module, _inputs: Any, output: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    return output.to(dtype)


def _cast_input(_module: nn.Module, args: tuple[Any, ...], *, dtype: torch.dtype) -> tuple[Any, ...]:
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        return (args[0].to(dtype),) + tuple(args[1:])
    return args


def apply_residual_dtype(model: nn.Module, *, dtype: torch.dtype) -> None:
    """Keep the residual stream of ``model`` (a whole GPT or a pipeline chunk) in ``dtype``:
    the embedding lookups return it and every block receives its input in it."""
    for name in ("embed", "pos_embed"):
        module = getattr(model, name, None)
        if module is not None:
            module.register_forward_hook(functools.partial(_cast_output, dtype=dtype))
    for block in model.layers.values():
        block.register_forward_pre_hook(functools.partial(_cast_input, dtype=dtype))
