"""Selective recompute of an eager dense block without a dispatch mode: cheap steps rebuilt in backward.

While a block runs, every step the model marks rebuildable (``llmforge.models.rebuild``: the
norms, the residual add before the second norm, RoPE, the GQA repeat, the heads' merge, the
MLP's activation) leaves a recipe: the function and its inputs. A saved-tensors hook then
replaces any tensor autograd saves that is such a step's output (or a view of it) by its recipe,
so the output itself is freed after forward; when backward unpacks it, the recipe runs again
(no grad, the forward's autocast state) and gives the same values. A recipe's inputs are kept:
the block input, the fused q/k/v and first MLP linear's outputs, the attention output, the output
projection's (the residual add's other input). What the matmuls and attention save besides is
kept as usual, so no matmul and no attention runs twice, and forward pays one Python call per
step and one per saved tensor instead of a Python dispatch of every aten op.

Saved-tensor hooks already active around the block (activation offload, the memory measurement)
receive every kept tensor: what autograd saves besides the rebuilt outputs, and each recipe input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from llmforge.models.rebuild import watching

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


class _Recipe:
    """How one output was made; ``value()`` runs it again (once, then remembers it while held)."""

    __slots__ = ("fn", "args", "autocast", "unpack", "value_")

    def __init__(
        self, fn: Callable[..., torch.Tensor], args: tuple, *, autocast: Any, unpack: Callable[[Any], torch.Tensor] | None
    ) -> None:
        self.fn, self.args, self.autocast, self.unpack = fn, args, autocast, unpack
        self.value_: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self.value_ is None:
            args = [self._argument(a) for a in self.args]
            with torch.no_grad(), self.autocast():
                self.value_ = self.fn(*args)
        return self.value_

    def _argument(self, arg: Any) -> Any:
        if isinstance(arg, _Recipe):
            return arg.value()
        if isinstance(arg, _Packed):
            return self.unpack(arg.packed) if self.unpack is not None else arg.packed
        return arg


class _Packed:
    """A recipe input as the outer saved-tensor hooks packed it."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


class _Rebuilt:
    """A saved tensor to rebuild: its recipe and where it sits in the recipe's output."""

    __slots__ = ("recipe", "size", "stride", "offset", "whole")

    def __init__(self, recipe: _Recipe, made: torch.Tensor, saved: torch.Tensor) -> None:
        self.recipe = recipe
        self.size, self.stride = saved.size(), saved.stride()
        self.offset = saved.storage_offset() - made.storage_offset()
        self.whole = self.offset == 0 and self.size == made.size() and self.stride == made.stride()

    def tensor(self) -> torch.Tensor:
        value = self.recipe.value()
        if self.whole:
            return value
        return value.as_strided(self.size, self.stride, value.storage_offset() + self.offset)


#: The tensors whose outputs are rebuilt: plain ones, and the fake ones of a rehearsal or ``--measure``
#: (not parameters, not DTensors).
_PLAIN = (torch.Tensor, FakeTensor)

#: Autograd nodes of the views a linear takes of its input (3-d to 2-d) before its matmul.
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AsStridedBackward0"})


def _cast_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def _autocast_state(device_type: str) -> Callable[[], Any]:
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext
    dtype = torch.get_autocast_dtype(device_type)
    return lambda: torch.autocast(device_type, dtype=dtype)


class BlockRebuild:
    """One block's forward: the recipes of its rebuildable steps and the hooks that use them."""

    def __init__(self, *, device_type: str, outer: Hooks | None) -> None:
        self.made: dict[int, tuple[torch.Tensor, _Recipe]] = {}  # by storage, until forward ends
        self.recipes: dict[int, _Recipe] = {}
        self.inputs: dict[int, tuple[torch.Tensor, _Packed]] = {}  # the tensor held so its id stays its own
        self.nodes: dict[Any, tuple[torch.Tensor, _Recipe]] = {}  # by the autograd node that made the output
        self.casts: dict[Any, _Recipe] = {}
        self.autocast = _autocast_state(device_type)
        self.outer = outer

    def watch(self, out: torch.Tensor, fn: Callable[..., torch.Tensor], args: tuple) -> None:
        if type(out) not in _PLAIN:
            return
        key = out.untyped_storage()._cdata  # the storage (fake tensors have one too)
        if not out.numel() or any(isinstance(a, torch.Tensor) and a.untyped_storage()._cdata == key for a in args):
            return  # empty, or a view of an input: nothing to free
        recipe = _Recipe(fn, tuple(self._input(a) for a in args), autocast=self.autocast, unpack=self.outer and self.outer[1])
        self.made[key] = (out, recipe)
        self.recipes[id(out)] = recipe
        if out.grad_fn is not None:
            self.nodes[out.grad_fn] = (out, recipe)

    def _input(self, arg: Any) -> Any:
        if not isinstance(arg, torch.Tensor):
            return arg
        recipe = self.recipes.get(id(arg))
        if recipe is not None:
            return recipe
        known = self.inputs.get(id(arg))
        if known is None:  # each input packed once (an offload copies it once)
            known = self.inputs[id(arg)] = (arg, _Packed(self.outer[0](arg) if self.outer else arg))
        return known[1]

    def pack(self, t: torch.Tensor) -> Any:
        if type(t) in _PLAIN:
            entry = self.made.get(t.untyped_storage()._cdata)
            if entry is not None and entry[0].dtype == t.dtype:
                return _Rebuilt(entry[1], entry[0], t)
            if t.grad_fn is not None:
                cast = self._cast(t)
                if cast is not None:
                    return cast
        return self.outer[0](t) if self.outer else t

    def _cast(self, t: torch.Tensor) -> _Rebuilt | None:
        """A dtype cast of a rebuildable output, or a view of it, rebuilt as that output cast again:
        autocast's copy of a norm's fp32 output a linear saves (fp32 residual stream, 16-bit compute),
        a CPU RMSNorm's fp32 upcast of the residual add."""
        node = t.grad_fn
        if node.name() in _VIEWS:
            node = node.next_functions[0][0]
        if node is None or node.name() != "ToCopyBackward0":
            return None
        entry = self.nodes.get(node.next_functions[0][0])
        whole = t if t._base is None else t._base  # the cast itself
        if entry is None or (whole.size(), whole.stride(), whole.device) != (entry[0].size(), entry[0].stride(), entry[0].device):
            return None
        cast = self.casts.get(node)
        if cast is None:
            cast = self.casts[node] = _Recipe(_cast_to, (entry[1], t.dtype), autocast=contextlib.nullcontext, unpack=None)
        return _Rebuilt(cast, whole, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Rebuilt):
            return packed.tensor()
        return self.outer[1](packed) if self.outer else packed

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        try:
            with watching(self.watch), torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            for held in (self.made, self.recipes, self.inputs, self.nodes, self.casts):
                held.clear()


def _outer_hooks() -> Hooks | None:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class RebuiltModule:
    """Mixin placed in front of a dense block's class: its forward rebuilds its cheap steps in backward."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
        with BlockRebuild(device_type=x.device.type, outer=_outer_hooks()).active():
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
