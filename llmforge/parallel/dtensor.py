"""Reading the local shard of a tensor that may be a DTensor."""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of ``t`` (``t`` itself when it is a plain tensor or None)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank holds of ``t``."""
    return local(t).numel()


def local_values(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` as a plain tensor: also unwraps the tensor subclasses that
    keep their values in an inner tensor (torchao's float8 weights under FSDP), which
    support only the ops their training needs."""
    t = local(t)
    inner = getattr(t, "_tensor", None)
    return inner if type(t) is not torch.Tensor and isinstance(inner, torch.Tensor) else t


class DTensorCalls(TorchDispatchMode):
    """Counts the operator calls that reach it with a DTensor argument (those issued inside
    another operator's dispatch do not reach a mode: they are that operator's work)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtensor = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(x, DTensor) for x in tree_leaves((args, kwargs or {}))):
            self.dtensor += 1
        return func(*args, **(kwargs or {}))


class PythonCalls:
    """Counts the Python-level calls (functions, and C functions called from Python) this
    thread makes inside it: the host work a DTensor call brings with it, in a measure that
    does not depend on how busy the machine is."""

    def __init__(self) -> None:
        self.calls = 0

    def _count(self, frame, event: str, arg) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def __enter__(self) -> PythonCalls:
        self._previous = sys.getprofile()
        sys.setprofile(self._count)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)
