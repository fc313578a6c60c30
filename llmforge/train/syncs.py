"""Count the points where the host waits for the device.

A training step should queue its work and move on; every read of a device value
(``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, a copy to the CPU) makes the
host wait until the device has caught up. ``HostSyncCounter`` counts them while it
is active:

- ``aten._local_scalar_dense`` (what ``.item()``, ``float()``, ``int()`` and
  ``bool()`` of a tensor run), on any device;
- copies from a non-CPU device to the CPU (``_to_copy``/``copy_``);
- ``Tensor.tolist()``, ``Tensor.numpy()`` and ``Tensor.cpu()`` of CPU tensors,
  which dispatch no copy: on CPU they stand for the reads a GPU run would sync on.

On a CPU-only machine every tensor is a CPU tensor, so the counter is
conservative: it counts each read a GPU run would wait for, and reads of
host-only data too. ``host`` names tensors that live on the host in a GPU run
as well (the optimizer's step counters of the for-loop AdamW): reads of those
are not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from llmforge.train.callbacks import Callback

aten = torch.ops.aten
_READS = (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu)


def _to_host(func: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    if func in (aten._to_copy.default, aten.copy_.default):
        src = args[0] if func is aten._to_copy.default else args[1]
        if not isinstance(src, torch.Tensor) or src.device.type in ("cpu", "meta"):
            return False
        dst = kwargs.get("device") if func is aten._to_copy.default else args[0].device
        return dst is not None and torch.device(dst).type == "cpu"
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and not self.owner.is_host(args[0]):
            self.owner.record(str(func))
        elif _to_host(func, args, kwargs):
            self.owner.record(str(func))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            func in _READS
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type == "cpu"
            and not self.owner.is_host(args[0])
        ):
            self.owner.record(func.__name__)
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """``with HostSyncCounter() as syncs: ...``; then ``syncs.count`` and ``syncs.by_op``."""

    def __init__(self, *, host: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        self.host = host
        self.count = 0
        self.by_op: dict[str, int] = {}
        self._modes = (_Function(self), _Dispatch(self))

    def record(self, name: str) -> None:
        self.count += 1
        self.by_op[name] = self.by_op.get(name, 0) + 1

    def is_host(self, t: torch.Tensor) -> bool:
        if self.host is None or t.device.type != "cpu":
            return False
        return t.data_ptr() in {h.data_ptr() for h in self.host()}

    def reset(self) -> None:
        self.count = 0
        self.by_op = {}

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class StepSyncs(Callback):
    """Host synchronisations of each training step after the first ``skip`` (the
    first sets things up), of ``count`` steps (None: all): pass it as the loop's last
    run part and run the loop inside ``with StepSyncs(...)``. A step's count closes when the
    loop asks this part ``should_stop``, after every earlier part answered (a stop vote
    belongs to the step that held it). Disabled, it counts nothing and costs nothing."""

    def __init__(
        self, *, host: Callable[[], Iterable[torch.Tensor]] | None = None, enabled: bool = True, skip: int = 1, count: int | None = None
    ) -> None:
        self.counter = HostSyncCounter(host=host)
        self.enabled = enabled
        self.skip = skip
        self.count = count
        self.per_step: list = []
        #: What each counted step's synchronisations were, by op (``HostSyncCounter.by_op``).
        self.ops_per_step: list[dict[str, int]] = []
        self._active = False
        self._seen = 0

    def should_stop(self) -> bool:
        self._next_step()
        return False

    def _next_step(self) -> None:
        self._seen += 1
        if self._active:
            self.per_step.append(self.counter.count)
            self.ops_per_step.append(self.counter.by_op)
            self.counter.reset()
            if self.count is not None and len(self.per_step) >= self.count:
                self.__exit__(None, None, None)
        elif self.enabled and self._seen >= self.skip and (self.count is None or len(self.per_step) < self.count):
            self.counter.__enter__()
            self._active = True

    def __enter__(self) -> StepSyncs:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._active:
            self.counter.__exit__(*exc)
            self._active = False
