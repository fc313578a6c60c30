"""Tensor parallelism with DTensor (Megatron-style), applied to a GPT from outside.

- attention: the fused q/k/v projection column-parallel (each rank owns ``heads / tp``
  q heads and the k/v heads of their groups: ``llmforge.models.fused``), o row-parallel;
- MLP: the fused gate/up (or up) projection column-parallel, down row-parallel;
- MoE MLP (router, experts, shared experts): not sharded. Every tp rank routes
  the same tokens and runs the same experts (split over the ep ranks, if any).
  With sequence parallel the layer gathers the whole sequence on entry and each
  rank keeps its own sequence shard of the output (backward all-gathers the
  output gradient), so routing, capacity and the router losses see the whole
  microbatch, as in one process;
- embedding vocab-parallel (rows of the table split over tp, partial lookups summed);
- output layer: the (tied or separate) weight split over the vocabulary, so the
  logits stay sharded and the loss is computed on them with ``loss_parallel``;
- sequence parallel (``parallel.sequence_parallel``): norms, residual adds and
  dropout run on a sequence shard; attention and MLP gather the sequence on entry
  (one gather for all their column-parallel linears, which keep only the shard for
  backward and gather it again there: ``llmforge.parallel.sequence``) and
  reduce-scatter it on exit, in one op with the row-parallel linear that makes the
  partial sum, so that only the shard outlives it. Under async TP (``async_tp``) the column-parallel linears
  take torch's styles instead (the sublayer's input gathered before them, as DTensor
  collectives in the compiled graph), so Inductor's micro-pipeline pass sees every
  all-gather next to the matmul it feeds and every reduce-scatter next to the matmul
  that produces it; they then save the gathered input for backward, not the shard.

Between blocks (and between pipeline stages) the residual stream is a plain local
tensor: the full sequence without sequence parallel, this rank's sequence shard with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from llmforge.blockspec.block import Block
from llmforge.blockspec.block import describe as describe_block
from llmforge.blockspec.dims import dims_of, is_moe_layer
from llmforge.models.gpt import GPT
from llmforge.parallel.dtensor import local
from llmforge.parallel.sequence import apply_sp_linears, apply_sp_row_linear


def apply_tp(model: GPT, *, tp_mesh: DeviceMesh, sequence_parallel: bool, async_tp: bool = False) -> None:
    """Shard ``model`` (a whole GPT or one pipeline chunk of it) over ``tp_mesh`` in place
    (``async_tp``: the column-parallel linears in torch's styles, see the module's docstring)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    if model.embed is not None:
        parallelize_module(model.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        if sequence_parallel:
            # Positions are added to the full sequence; each rank then keeps its shard.
            to_shard = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
            parallelize_module(model.embed_dropout, tp_mesh, to_shard)
    dims = dims_of(model.config)
    for index, block in model.layers.items():
        spec = describe_block(dims, moe=is_moe_layer(dims, int(index)))
        own = _sp_groups(block, spec) if sequence_parallel and not async_tp else {}
        rows = _sp_rows(block, spec) if sequence_parallel and not async_tp else []
        plan = _block_plan(spec, seq=seq, sequence_parallel=sequence_parallel, own=own, own_rows=rows)
        parallelize_module(block, tp_mesh, plan)
        for parent, names in own.items():
            apply_sp_linears(getattr(block, parent), names, tp_mesh=tp_mesh)
        for name in rows:
            apply_sp_row_linear(block.get_submodule(name), tp_mesh=tp_mesh)
    if sequence_parallel and model.embed is None:
        model.register_forward_pre_hook(_whole_sequence_positions(tp_mesh.size()), with_kwargs=True)
    if model.head is not None:
        parallelize_module(model.head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    if model.norm is not None:
        if sequence_parallel:
            parallelize_module(model.norm, tp_mesh, SequenceParallel(use_local_output=False))
        # The output layer multiplies a replicated DTensor by the vocab-sharded weight.
        gather = PrepareModuleOutput(output_layouts=seq, desired_output_layouts=Replicate(), use_local_output=False)
        parallelize_module(model.norm, tp_mesh, gather)


def _whole_sequence_positions(tp: int):
    """A later pipeline chunk receives this rank's shard of the sequence (``[b, s / tp, h]``) under
    sequence parallel, and its blocks attend over the whole sequence: its positions (RoPE, masks)
    are the whole sequence's, not the shard's length."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict):
        if kwargs.get("positions") is None and args:
            kwargs = {**kwargs, "positions": torch.arange(args[0].shape[1] * tp, device=args[0].device)}
        return args, kwargs

    return hook


def _sp_groups(block: nn.Module, spec: Block) -> dict[str, list[str]]:
    """The column-parallel linears that ``apply_sp_linears`` runs under sequence
    parallel, by parent module: plain ``nn.Linear`` layers only (float8 linears keep
    torch's styles, which gather the input before them)."""
    return {
        parent: names
        for parent, names in _column_linears(spec).items()
        if all(type(block.get_submodule(f"{parent}.{n}")) is nn.Linear for n in names)
    }


def _sp_rows(block: nn.Module, spec: Block) -> list[str]:
    """The row-parallel linears that ``apply_sp_row_linear`` runs under sequence parallel:
    plain ``nn.Linear`` layers only (float8 linears keep torch's ``RowwiseParallel``)."""
    return [x.name for x in spec.sharded("row") if type(block.get_submodule(x.name)) is nn.Linear]


def _column_linears(spec: Block) -> dict[str, list[str]]:
    """The column-parallel linears of a block by parent module, as its description lists them
    (an MoE layer has none: it is not sharded)."""
    groups: dict[str, list[str]] = {}
    for linear in spec.sharded("col"):
        groups.setdefault(linear.parent, []).append(linear.leaf)
    return groups


def _block_plan(
    spec: Block, *, seq, sequence_parallel: bool, own: dict[str, list[str]], own_rows: Collection[str] = ()
) -> dict[str, ParallelStyle]:
    """The row-parallel linears that ``own_rows`` (run by ``apply_sp_row_linear``) does not name,
    and the column-parallel linears that ``own`` (run by ``apply_sp_linears``) does not name,
    their inputs gathered first under sequence parallel."""
    plan: dict[str, ParallelStyle] = {
        linear.name: RowwiseParallel(output_layouts=seq) for linear in spec.sharded("row") if linear.name not in own_rows
    }
    for parent, names in _column_linears(spec).items():
        if parent in own:
            continue
        plan.update({f"{parent}.{n}": ColwiseParallel() for n in names})
        if sequence_parallel:
            inputs = (Shard(1), None) if parent == "attn" else (Shard(1),)
            plan[parent] = PrepareModuleInput(
                input_layouts=inputs, desired_input_layouts=(Replicate(),) + inputs[1:], use_local_output=True
            )
    if sequence_parallel:
        plan.update({norm.name: SequenceParallel() for norm in spec.norms})
        if spec.mlp == "moe":
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
    return plan


def sharded_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss on vocab-sharded logits (call inside ``loss_context``).
    Returns a plain scalar tensor whose backward goes through the sharded logits."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    return local(loss)


def loss_context(tp: int):
    """The context forward-loss and backward must run in when logits are vocab-sharded."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def align_grads(params: list[nn.Parameter]) -> None:
    """Give each DTensor gradient its parameter's placements. Autograd may leave a
    gradient partial over tensor-parallel ranks (a replicated norm applied to a
    sequence shard) or replicated where the parameter is sharded (the vocab-parallel
    embedding); reductions, clipping and the tied-embedding sync expect the layout
    of the parameter."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(device_mesh=p.device_mesh, placements=p.placements)
