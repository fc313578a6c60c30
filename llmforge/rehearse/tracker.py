"""Tensor bytes live on a rank, by the estimator's items, at the peak of a stretch of program.

A ``TorchDispatchMode`` (as torch's ``MemTracker``, whose storage bookkeeping it follows):
every storage an op returns is counted once until it is freed (its Python storage object is
collected) or resized (FSDP2 frees and refills its buffers with ``UntypedStorage.resize_``).
Tensors on the meta device hold no bytes and are not counted (the build makes each model part
there before it allocates this rank's shards; a fake tensor reports the device it stands for).
Each storage gets a category when first seen and may be re-tagged once its role is known:

- ``weights``: parameters and buffers as built (this rank's shards), tagged at the start;
- ``compute_copies``: a module's parameters that are not ``weights`` when its forward starts
  (FSDP2's gathered, unsharded copies);
- ``grads``: a parameter's ``.grad`` once the step's backward is done (``tag_grads``), and
  FSDP2's whole gradients kept between the microbatches that do not reduce them (ZeRO 1-2
  accumulate there: the estimate's whole gradients), once each parameter group's backward ends;
- ``optimizer``: the optimizer's states once its step is done (``tag_optimizer``);
- ``activations``: what forward allocates (the tensors saved for backward among them);
- ``transient``: what backward and the optimizer step allocate (recomputation, gradients
  of activations, gradient buffers before reduction, the optimizer's temporaries).

torch's ``MemTracker`` tags by phase only (optimizer step, backward, else activation) and
keeps per-module snapshots that refuse a module called twice in one step (a microbatch
loop); tagging by identity after the fact is what lets its figures be read as the
estimator's items. The peak is kept as the list of storages live at it, so a later
re-tag (a gradient known as one only after backward) applies to it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("weights", "compute_copies", "grads", "optimizer", "activations", "transient")


def _inner_names(t: torch.Tensor) -> list[str]:
    """The inner tensors of a wrapper subclass. torchao's float8 weight wrapper says whether it
    has a scale by reading the scale as a bool, which a fake tensor cannot answer: asked by name."""
    if type(t).__name__ == "WeightWithDynamicFloat8CastTensor":
        return ["_tensor"] + (["_precomputed_scale"] if getattr(t, "_precomputed_scale", None) is not None else [])
    return list(t.__tensor_flatten__()[0])


def get_untyped_storages(t: torch.Tensor) -> set:
    """The storages behind ``t`` and its inner tensors (torch's ``MemTracker`` helper of the same
    name, with float8 weights: ``_inner_names``)."""
    pending, out = [t], set()
    while pending:
        obj = pending.pop()
        if is_traceable_wrapper_subclass(obj):
            pending.extend(v for v in (getattr(obj, n) for n in _inner_names(obj)) if isinstance(v, torch.Tensor))
        elif isinstance(obj, torch.Tensor):
            out.add(obj.untyped_storage())
    return out


@dataclass
class _Storage:
    bytes: int
    category: str


def _sharding_propagation(tracker: PeakTracker):
    """Leave out the tensors DTensor makes to find an op's output shapes: global-shape fake
    tensors that no rank holds (under a fake mode DTensor makes them in that same mode, so
    they reach the tracker). Returns the method it replaced."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        tracker._propagating = True
        try:
            return original(self, op_schema)
        finally:
            tracker._propagating = False

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    return original


def _fsdp_accumulated_grads(tracker: PeakTracker):
    """Tag FSDP2's unsharded gradients as ``grads`` when a parameter group's backward leaves them
    unreduced (a microbatch without gradient sync). Returns the method it replaced."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.post_backward

    def post_backward(self, *args):
        out = original(self, *args)
        for fsdp_param in self.fsdp_params:
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None and hasattr(fsdp_param, "_unsharded_param"):
                grad = fsdp_param.unsharded_param.grad
            if grad is not None:
                tracker._tag(grad, "grads")
        return out

    FSDPParamGroup.post_backward = post_backward  # type: ignore[method-assign]
    return original


class PeakTracker(TorchDispatchMode):
    """Bytes live at the peak by category: ``peak_bytes`` and ``peak_by_category()``; and
    ``activations_peak_bytes``, the most the storages tagged activations held at once (at the
    end of the forward, or of the pipeline's warm-up, whenever the step's peak comes)."""

    def __init__(self, *, modules: Iterable[nn.Module] = (), optimizer=None) -> None:
        super().__init__()
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, tuple[weakref.ref, _Storage]] = {}  # every live storage, by id of its _Storage
        self.current = 0
        self._activations = 0  # bytes live now in storages tagged activations
        self.activations_peak_bytes = 0  # the most those ever held at once
        self.peak_bytes = 0
        self._peak: list[tuple[_Storage, int]] = []
        self._rising = False
        self._in_optimizer = False
        self._propagating = False
        self._handles: list = []
        for module in modules:
            for t in list(module.parameters()) + list(module.buffers()):
                self._tag(t, "weights")
        if optimizer is not None:
            self.tag_optimizer(optimizer)

    # bookkeeping ------------------------------------------------------------------------
    def _seen(self, st: torch.UntypedStorage) -> _Storage:
        info = self._live.get(st)
        if info is None:
            info = _Storage(bytes=0, category="")
            self._live[st] = info
            key = id(info)
            self._refs[key] = (weakref.ref(st, lambda _, info=info, key=key: self._freed(info, key)), info)
        return info

    def _resize(self, info: _Storage, nbytes: int) -> None:
        if nbytes < info.bytes:
            self._mark_peak()
        self.current += nbytes - info.bytes
        if info.category == "activations":
            self._count_activations(nbytes - info.bytes)
        info.bytes = nbytes
        if self.current > self.peak_bytes:
            self.peak_bytes, self._rising = self.current, True

    def _count_activations(self, delta: int) -> None:
        self._activations += delta
        self.activations_peak_bytes = max(self.activations_peak_bytes, self._activations)

    def _recategorize(self, info: _Storage, category: str) -> None:
        if info.category == "activations":
            self._activations -= info.bytes
        info.category = category
        if category == "activations":
            self._count_activations(info.bytes)

    def _freed(self, info: _Storage, key: int) -> None:
        self._resize(info, 0)
        self._refs.pop(key, None)

    def _mark_peak(self) -> None:
        """Keep the live storages when the total is about to fall from a new peak."""
        if self._rising:
            self._peak = [(info, info.bytes) for _, info in self._refs.values() if info.bytes]
            self._rising = False

    def _track(self, t: torch.Tensor, category: str) -> None:
        if t.device.type == "meta":
            return
        for st in get_untyped_storages(t):
            info = self._seen(st)
            if not info.category:
                self._recategorize(info, category)
            if st.nbytes() != info.bytes:
                self._resize(info, st.nbytes())

    def _tag(self, t: torch.Tensor, category: str) -> None:
        if t.device.type == "meta":
            return
        for st in get_untyped_storages(t):
            info = self._seen(st)
            self._recategorize(info, category)
            if st.nbytes() != info.bytes:
                self._resize(info, st.nbytes())

    # what the rehearsal tells it ------------------------------------------------------------
    def tag_grads(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if p.grad is not None:
                self._tag(p.grad, "grads")

    def tag_optimizer(self, optimizer) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._tag(value, "optimizer")

    def _compute_copies(self, module: nn.Module, _inputs) -> None:
        for p in module.parameters(recurse=False):
            for st in get_untyped_storages(p):
                info = self._live.get(st)
                if info is None or info.category != "weights":
                    self._tag(p, "compute_copies")
                    break

    # results -------------------------------------------------------------------------------
    def peak_by_category(self) -> dict[str, int]:
        """Bytes live at the peak, by category (re-tags made after the peak included)."""
        self._mark_peak()
        out = dict.fromkeys(CATEGORIES, 0)
        for info, nbytes in self._peak:
            out[info.category or "activations"] += nbytes
        return out

    # the mode ------------------------------------------------------------------------------
    def __enter__(self) -> PeakTracker:
        self._fake_on_entry = active_fake_mode()
        self._original_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int):
            tracker._original_resize(st, size)
            info = tracker._live.get(st)
            if info is not None and info.bytes != st.nbytes():
                tracker._resize(info, st.nbytes())

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._original_propagate = _sharding_propagation(self)
        self._original_post_backward = _fsdp_accumulated_grads(self)
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._compute_copies),
            register_optimizer_step_pre_hook(lambda *_: setattr(self, "_in_optimizer", True)),
            register_optimizer_step_post_hook(lambda *_: setattr(self, "_in_optimizer", False)),
        ]
        return super().__enter__()

    def __exit__(self, *args) -> None:
        for handle in self._handles:
            handle.remove()
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        ShardingPropagator._propagate_tensor_meta_non_cached = self._original_propagate  # type: ignore[method-assign]
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        FSDPParamGroup.post_backward = self._original_post_backward  # type: ignore[method-assign]
        self._mark_peak()
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which are counted
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode():
            out = args[0]  # the fake kernel returns a new tensor; the real one returns its input
        else:
            out = func(*args, **(kwargs or {}))
        if not self._propagating and active_fake_mode() is self._fake_on_entry:
            if self._in_optimizer or torch._C._current_graph_task_id() != -1:
                category = "transient"
            else:
                category = "activations"
            tree_map_only(torch.Tensor, lambda t: self._track(t, category), out)
        return out
