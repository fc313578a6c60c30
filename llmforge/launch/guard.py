"""A check that every collective is handed tensors on the rank's compute device.

NCCL carries CUDA tensors only: a CPU tensor handed to a collective on a GPU
rank fails there, or, on a group that also carries CPU tensors, goes over gloo
on every step. On CPU ranks (gloo) the mistake cannot show, so the test suite
and debugging sessions switch this check on with an environment variable that
the worker and the test harness read:

    LLMFORGE_CHECK_COLLECTIVES=1        # check
    LLMFORGE_CHECK_COLLECTIVES=FOLDER   # check, and write what was seen to
                                        # FOLDER/collectives-rank<R>-<pid>.json at exit

While installed, ``torch.distributed``'s tensor collectives raise
``CollectiveDeviceError`` (naming the calling line) when handed a tensor on
another device than the rank's. Exempt are object collectives (torch pickles
objects through CPU tensors by design) and, on GPU ranks, groups created for CPU
tensors (``new_group(backend="gloo")``, as background checkpointing uses).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "LLMFORGE_CHECK_COLLECTIVES"
TENSOR_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_gather_single",
    "reduce_scatter_single",
)
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor on another device than the rank computes on."""


class CollectiveGuard:
    """Wraps the collectives of ``torch.distributed`` (both its namespaces) while installed.

    ``seen`` counts ``"name:tensor device type"`` of every checked call."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = torch.device(device)
        self.seen: Counter = Counter()
        self._originals: dict[tuple, Callable] = {}
        self._inside_object = threading.local()

    def install(self) -> CollectiveGuard:
        for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrap = self._object if name in OBJECT_COLLECTIVES else self._tensor
            wrapped = wrap(name, original)  # one object in both namespaces: P2POp compares ops by identity
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._originals[(module, name)] = original
                    setattr(module, name, wrapped)
        return self

    def uninstall(self) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

    def _object(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._inside_object, "depth", 0)
            self._inside_object.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside_object.depth = depth

        return call

    def _tensor(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not getattr(self._inside_object, "depth", 0):
                group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                self.check(name, list(_tensors(args, kwargs)), group=group)
            return original(*args, **kwargs)

        return call

    def check(self, name: str, tensors: list[torch.Tensor], *, group: Any | None = None) -> None:
        """Record the call; raise CollectiveDeviceError on a tensor off the rank's device."""
        cpu_group = _is_cpu_group(group)
        for tensor in tensors:
            self.seen[f"{name}:{tensor.device.type}"] += 1
            if cpu_group and tensor.device.type == "cpu":
                continue
            if not _same_device(tensor.device, self.device):
                raise CollectiveDeviceError(
                    f"{name} was handed a tensor on {tensor.device} at {_caller()}, but this rank computes on "
                    f"{self.device}: create the tensor on the rank's device (NCCL carries no CPU tensors)"
                )

    def write(self, folder: Path) -> None:
        rank = os.environ.get("RANK", "0")
        path = Path(folder) / f"collectives-rank{rank}-{os.getpid()}.json"
        path.write_text(json.dumps({"device": str(self.device), "seen": dict(self.seen)}))


def _tensors(args: tuple, kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
                elif isinstance(getattr(item, "tensor", None), torch.Tensor):  # a P2POp
                    yield item.tensor


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def _is_cpu_group(group: Any | None) -> bool:
    """A group made for CPU tensors: a gloo-only group in a world whose default group
    carries other devices too (``cpu:gloo,cuda:nccl``)."""
    if group is None or not dist.is_initialized():
        return False
    try:
        return dist.get_backend() != "gloo" and dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        return False


def _caller() -> str:
    """The innermost calling line outside torch and this module."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path != here and not path.startswith(torch_dir):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "an unknown place"


_installed: CollectiveGuard | None = None


def install_from_env(device: torch.device) -> CollectiveGuard | None:
    """Install the guard for this rank's ``device`` when ``LLMFORGE_CHECK_COLLECTIVES`` is set."""
    global _installed
    value = os.environ.get(ENV, "")
    if not value or value == "0":
        return None
    if _installed is not None:
        _installed.device = torch.device(device)
        return _installed
    _installed = CollectiveGuard(device=device).install()
    if value != "1":
        atexit.register(_installed.write, Path(value))
    return _installed
