"""The cheap steps of a block that selective recompute rebuilds in backward instead of keeping.

A block calls each memory-bound step whose output a later op saves for backward through
``rebuildable(fn, *args)``: the norms, the residual add that feeds the second norm, RoPE, the
GQA repeat of keys and values, the merge of the attention heads and the MLP's activation.
With nobody watching it is ``fn(*args)``. Under ``parallel.recompute=selective``,
``llmforge.parallel.rebuild`` watches while an eager block runs: it learns how each such
output was made, so autograd keeps the recipe (``fn`` and its inputs) instead of the output
and backward runs ``fn`` again when it needs the value. The model knows nothing of who watches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: Called as ``watcher(output, fn, args)`` after each rebuildable step (innermost last).
Watcher = Callable[[torch.Tensor, Callable[..., torch.Tensor], tuple[Any, ...]], None]
_WATCHERS: list[Watcher] = []


def rebuildable(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``, a step that depends on nothing but its arguments (no randomness), whose output
    and arguments nothing modifies in place afterwards (backward may run it again from them)."""
    out = fn(*args)
    if _WATCHERS:
        _WATCHERS[-1](out, fn, args)
    return out


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """While active, ``watcher`` sees every rebuildable step."""
    _WATCHERS.append(watcher)
    try:
        yield
    finally:
        _WATCHERS.pop()
