"""Activation recomputation (``parallel.recompute``, ``parallel.recompute_every``).

``apply_recompute(model, *, mode, every, compiled)`` makes transformer blocks
recompute in backward, in place:

- ``none``: nothing changes; every block keeps what autograd saves.
- ``selective``: every block keeps the outputs of its matrix multiplications
  (q/k/v, output projection, MLP or expert up/gate/down, router; float8 ones and
  the absolute maxima their scales come from), of the fused attention kernel
  (its output and log-sum-exp statistics; FlexAttention's too) and of the
  collectives, and recomputes in backward the cheap memory-bound steps between
  them: norms, activation functions, RoPE, the GQA repeat, the residual add
  before the second norm. No matmul, no attention and no communication is
  repeated. Two mechanisms (``llmforge.layout.selective_rebuilds`` says which
  runs; the estimator follows the same rule):

  - an eager dense block without tensor parallelism keeps recipes for the steps
    the model marks rebuildable and rebuilds their outputs when backward unpacks
    them (``llmforge.parallel.rebuild``): one Python call per step and per saved
    tensor, none per aten op. Autograd's other saved tensors (norm statistics,
    autocast's weight copies) are kept as without recompute; the last matmul's
    output is not kept;
  - a compiled block (the policy is applied when the graph is traced and costs
    nothing per step), an MoE block and a tensor-parallel one use torch's op-level
    selective checkpointing (``create_selective_checkpoint_contexts`` with a
    ``CheckpointPolicy`` per op, as torchtitan does), which also recomputes
    dropout, casts, routing and dispatch bookkeeping; in eager mode it runs a
    Python dispatch mode over every aten op of the block and of its recompute.
- ``full``: a block keeps only its input and reruns its whole forward in
  backward; with ``every = N`` only blocks whose layer index is a multiple of N
  (0, N, 2N, ...) are checkpointed and the others keep everything.

Blocks are found in ``model.layers`` (an ``nn.ModuleDict`` keyed by the global
layer index), so a pipeline stage checkpoints the same layers it would in one
process. Wrapping swaps each block's class for a checkpointing (or rebuilding)
subclass, so parameter names do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import llmforge.parallel.sequence  # noqa: F401  (registers the llmforge:: ops _save_ops names)
from llmforge.config.choices import Recompute
from llmforge.layout import selective_rebuilds
from llmforge.models.layers import MLP
from llmforge.parallel.rebuild import RebuiltModule

MODES = Recompute.names()

aten = torch.ops.aten


ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def _save_ops() -> frozenset:
    """Ops whose outputs selective recompute keeps: matmuls (float8 ones too), fused attention
    (FlexAttention too), communication (also the sequence-parallel gather + column-parallel
    linears, and the row-parallel linear + reduce-scatter, each as one op) and the absolute
    maxima float8 scales come from, as torchtitan keeps them: a compiled float8 block's graph
    shows ``_scaled_mm`` and ``max`` where an eager one shows ``mm`` on float8 tensors, and a
    scale costs one pass over its tensor to rebuild."""
    ops: list[object] = [
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.linear.default,
        aten._scaled_mm.default,
        aten.max.default,
        aten.amax.default,
        torch.ops.llmforge.sp_column_linears.default,
        torch.ops.llmforge.sp_row_linear.default,
    ]
    ops += [getattr(aten, name).default for name in ATTENTION_OPS if hasattr(aten, name)]
    flex = getattr(torch._higher_order_ops, "flex_attention", None)
    if flex is not None:
        ops.append(flex)
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor"):
        if functional is not None and hasattr(functional, name):
            ops.append(getattr(functional, name).default)
    return frozenset(ops)


SAVE_OPS = _save_ops()


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul, attention and collective outputs; recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple:
    """A fresh pair of forward/recompute contexts for one checkpointed call."""
    return create_selective_checkpoint_contexts(selective_policy)


class CheckpointedModule:
    """Mixin placed in front of a block's class: its forward runs under checkpoint."""

    recompute_context: Callable[[], tuple] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        options: dict[str, Any] = {"use_reentrant": False}
        if self.recompute_context is not None:
            options["context_fn"] = self.recompute_context
        return checkpoint(super().forward, *args, **options, **kwargs)  # type: ignore[misc]


@functools.cache
def _checkpointed_class(cls: type) -> type:
    return type(f"Checkpointed{cls.__name__}", (CheckpointedModule, cls), {})


@functools.cache
def _rebuilt_class(cls: type) -> type:
    return type(f"Rebuilt{cls.__name__}", (RebuiltModule, cls), {})


def _swap_class(module: nn.Module, subclass_of: Callable[[type], type]) -> None:
    """Give ``module`` a recomputing subclass of its class, once."""
    if isinstance(module, (CheckpointedModule, RebuiltModule)):
        raise ValueError(f"{type(module).__name__} is already checkpointed")
    module.__class__ = subclass_of(type(module))


def checkpoint_module(module: nn.Module, *, context: Callable[[], tuple] | None) -> None:
    """Make ``module``'s forward checkpointed (selective when ``context`` is given)."""
    _swap_class(module, _checkpointed_class)
    module.recompute_context = context


def rebuild_module(block: nn.Module) -> None:
    """Make a dense block's forward rebuild its cheap steps in backward (``llmforge.parallel.rebuild``)."""
    _swap_class(block, _rebuilt_class)


def rebuilds(block: nn.Module, *, compiled: bool) -> bool:
    """Whether selective recompute of ``block`` rebuilds its cheap steps rather than running op-level
    selective checkpointing (the rule the estimator reads too: ``llmforge.layout.selective_rebuilds``)."""
    sharded = any(isinstance(p, DTensor) for p in block.parameters())  # tensor parallel (FSDP comes later)
    moe = not isinstance(getattr(block, "mlp", None), MLP)
    return selective_rebuilds(tp=2 if sharded else 1, moe=moe, compiled=compiled)


def apply_recompute(model: nn.Module, *, mode: str, every: int = 1, compiled: bool = False) -> nn.Module:
    """Checkpoint the transformer blocks of ``model`` (or of a pipeline stage) in place;
    ``compiled``: the blocks will be compiled (selective recompute then uses op-level checkpointing)."""
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(MODES)}")
    if every < 1:
        raise ValueError(f"recompute every must be at least 1, got {every}")
    if mode == Recompute.NONE:
        return model
    for name, block in model.layers.items():
        if mode == Recompute.FULL and int(name) % every:
            continue
        if mode == Recompute.SELECTIVE and rebuilds(block, compiled=compiled):
            rebuild_module(block)
        else:
            checkpoint_module(block, context=selective_context if mode == Recompute.SELECTIVE else None)
    return model
