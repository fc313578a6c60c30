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

The op is a ``torch.library.custom_op`` so that selective recompute can keep its
outputs as one op (``llmforge.parallel.recompute``): recomputing a block then
neither gathers nor multiplies again. It computes in autocast's dtype when autocast
is on (the input shard is cast before the gather, so the gather moves 16-bit
data) and casts each weight itself, so autocast keeps no copies of these weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

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
