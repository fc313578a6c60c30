"""Sequence-parallel column-parallel linears that keep only their input's sequence shard.

Under sequence parallel the attention and MLP inputs arrive split over the sequence
([b, s/t, h] per tensor-parallel rank) and the column-parallel linears (the fused
q/k/v and gate/up projections, or up) need the whole sequence. Gathering it before the linears, as torch's
``PrepareModuleInput`` does, leaves the gathered [b, s, h] input saved for backward
by every linear. As Megatron-LM does (Korthikanti et al. 2022, §4.2.2), one op
here gathers the input once for all the linears of a sublayer, keeps only the
local shard (in the compute dtype) for backward, and gathers it again in backward
for the weight gradients; the input gradient is reduce-scattered back to the
shard.

The row-parallel linears (o, down) end the sublayer: each rank multiplies its slice of
the features into a partial sum of the whole sequence at full width ([b, s, h]) and the
sum is reduce-scattered back to the sequence shard. One op here does both and returns
only the shard, so the full-width partial sum lives only inside the op; backward
gathers the output gradient over the sequence and reads the op's input, never its
partial sum (Megatron-LM's ``RowParallelLinear`` with sequence parallel).

The ops are ``torch.library.custom_op``s so that selective recompute can keep their
outputs as one op each (``llmforge.parallel.recompute``): recomputing a block then
neither gathers nor multiplies nor reduces again, and keeps no partial sum. They
compute in autocast's dtype when autocast is on (the input shard is cast before the
gather, so the gather moves 16-bit data) and cast each weight themselves, so autocast
keeps no copies of these weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor

from llmforge.parallel.dtensor import local

# the same functional collectives DTensor uses (renamed *_single in recent torch)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _gather(shard: torch.Tensor, group: str) -> torch.Tensor:
    """[b, s/t, h] on each rank -> [b, s, h] (rank order along the sequence)."""
    return _wait(_all_gather(shard.contiguous(), gather_dim=1, group=group))


@torch.library.custom_op("llmforge::sp_column_linears", mutates_args=())
def sp_column_linears(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], group: str, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``[linear(gather(x), w, b) for w, b]`` in ``dtype``; ``biases`` empty or one per weight."""
    full = _gather(x.to(dtype), group)
    bs = biases if biases else [None] * len(weights)
    return [F.linear(full, w.to(dtype), None if b is None else b.to(dtype)) for w, b in zip(weights, bs, strict=False)]


@sp_column_linears.register_fake
def _(x, weights, biases, group, dtype):
    world = torch.distributed.distributed_c10d._resolve_process_group(group).size()
    b, s, _ = x.shape
    return [x.new_empty((b, s * world, w.shape[0]), dtype=dtype) for w in weights]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, weights, biases, group, dtype = inputs
    ctx.save_for_backward(x.to(dtype), *weights)
    ctx.group, ctx.dtype, ctx.x_dtype = group, dtype, x.dtype
    ctx.bias_dtypes = [b.dtype for b in biases]


def _backward(ctx: Any, grads: list[torch.Tensor | None]):
    shard, *weights = ctx.saved_tensors
    full = _gather(shard, ctx.group)
    flat = full.reshape(-1, full.shape[-1])
    grad_full = torch.zeros_like(flat)
    grad_weights, grad_biases = [], []
    for i, (g, w) in enumerate(zip(grads, weights, strict=False)):
        g = torch.zeros(flat.shape[0], w.shape[0], dtype=ctx.dtype, device=flat.device) if g is None else g.reshape(-1, w.shape[0])
        grad_full += g @ w.to(ctx.dtype)
        grad_weights.append((g.t() @ flat).to(w.dtype))
        if ctx.bias_dtypes:
            grad_biases.append(g.sum(0).to(ctx.bias_dtypes[i]))
    scattered = _wait(_reduce_scatter(grad_full.view(full.shape), "sum", scatter_dim=1, group=ctx.group))
    return scattered.to(ctx.x_dtype), grad_weights, grad_biases, None, None


sp_column_linears.register_autograd(_backward, setup_context=_setup)


class PrecomputedLinear(nn.Linear):
    """A column-parallel linear whose output its parent's pre-hook computed (the
    input it is called with only carries the whole sequence's shape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.__dict__.pop("_sp_output", None)
        if out is None:
            raise RuntimeError("a sequence-parallel linear was called outside its parent module's forward")
        return out


def _shard_rows(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


def apply_sp_linears(parent: nn.Module, names: list[str], *, tp_mesh: DeviceMesh) -> None:
    """Shard ``parent``'s column-parallel linears ``names`` over ``tp_mesh`` (rows:
    output features) and compute them in a forward pre-hook of ``parent`` from its
    sequence-sharded input with ``sp_column_linears``."""
    linears = [getattr(parent, n) for n in names]
    for linear in linears:
        distribute_module(linear, tp_mesh, _shard_rows)
        linear.__class__ = PrecomputedLinear
    group = tp_mesh.get_group().group_name
    size = tp_mesh.size()

    def pre_hook(_module: nn.Module, args: tuple) -> tuple:
        x = local(args[0])
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        weights = [local(m.weight) for m in linears]
        biases = [local(m.bias) for m in linears if m.bias is not None]
        for linear, out in zip(linears, sp_column_linears(x, weights, biases, group, dtype), strict=False):
            linear.__dict__["_sp_output"] = out
        b, s, h = x.shape
        return (x.new_empty(()).expand(b, s * size, h), *args[1:])

    parent.register_forward_pre_hook(pre_hook)


@torch.library.custom_op("llmforge::sp_row_linear", mutates_args=())
def sp_row_linear(x: torch.Tensor, weight: torch.Tensor, group: str, dtype: torch.dtype) -> torch.Tensor:
    """``reduce_scatter(linear(x, weight))`` over the sequence (dim 1) in ``dtype``: [b, s, f/t] -> [b, s/t, h]."""
    partial = F.linear(x.to(dtype), weight.to(dtype))
    return _wait(_reduce_scatter(partial, "sum", scatter_dim=1, group=group))


@sp_row_linear.register_fake
def _(x, weight, group, dtype):
    world = torch.distributed.distributed_c10d._resolve_process_group(group).size()
    b, s, _ = x.shape
    return x.new_empty((b, s // world, weight.shape[0]), dtype=dtype)


def _row_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    x, weight, group, dtype = inputs
    ctx.save_for_backward(x, weight)
    ctx.group, ctx.dtype = group, dtype


def _row_backward(ctx: Any, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    full = _gather(grad.to(ctx.dtype), ctx.group)  # [b, s, h]
    grad_x = (full @ weight.to(ctx.dtype)).to(x.dtype)
    flat_grad, flat_x = full.reshape(-1, full.shape[-1]), x.to(ctx.dtype).reshape(-1, x.shape[-1])
    return grad_x, (flat_grad.t() @ flat_x).to(weight.dtype), None, None


sp_row_linear.register_autograd(_row_backward, setup_context=_row_setup)


class SequenceParallelRowLinear(nn.Linear):
    """A row-parallel linear whose output is this rank's sequence shard of the reduced sum
    (``sp_row_linear``); its bias, replicated, is added to the shard."""

    group_name: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        out = sp_row_linear(local(x), local(self.weight), self.group_name, dtype)
        if self.bias is None:
            return out
        # each rank adds the bias to its own tokens: its gradient is a sum over the ranks
        bias = self.bias.to_local(grad_placements=[Partial()]) if isinstance(self.bias, DTensor) else self.bias
        return out + bias.to(dtype)


def _shard_columns(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(1)])))
    if module.bias is not None:
        module.register_parameter("bias", nn.Parameter(distribute_tensor(module.bias, mesh, [Replicate()])))


def apply_sp_row_linear(linear: nn.Linear, *, tp_mesh: DeviceMesh) -> None:
    """Shard ``linear`` over ``tp_mesh`` as torch's ``RowwiseParallel`` does (weight on its input
    features, bias replicated) and compute it with ``sp_row_linear``: the output is this rank's
    sequence shard, the full-width partial sum is never kept."""
    distribute_module(linear, tp_mesh, _shard_columns)
    linear.__class__ = SequenceParallelRowLinear
    linear.group_name = tp_mesh.get_group().group_name
