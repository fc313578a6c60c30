"""Stop signals as a run part: SIGTERM or SIGINT (preemption, Ctrl-C) ends the run after the
current step, with a checkpoint; a second signal of the same kind stops at once."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from llmforge.parallel.mesh import set_collective_timeout
from llmforge.train.callbacks import Callback


class StopSignal(Callback):
    """Turns SIGTERM/SIGINT into a request to stop after the current step.

    Ranks agree on it with an all-reduce of a flag on ``device``, the rank's compute
    device (NCCL carries no CPU tensors), read back on the host. That read waits for the
    device, so the vote is held only at logged steps, where the loop has just waited for
    the device anyway: a step that is not logged never waits, and a signal stops the run
    at the next logged step (within ``train.log_interval`` steps). One rank alone (one
    process, or a world of one under torchrun) needs no vote and stops after the current
    step. With ``mesh`` and ``timeout_s``, the first step's end also sets every
    collective's timeout to ``timeout_s`` (until then collectives get the first-step
    allowance)."""

    def __init__(self, *, device: torch.device | None = None, mesh: object | None = None, timeout_s: float | None = None) -> None:
        self._received: str | None = None
        self.device = device if device is not None else torch.device("cpu")
        self._tighten = (mesh, timeout_s) if timeout_s is not None and dist.is_initialized() else None
        self._vote_due = False

    @property
    def received(self) -> str | None:
        """The signal's name (``SIGTERM`` when another rank got it), or None."""
        return self._received

    def _handle(self, signum: int, frame: object) -> None:
        if self._received == signal.Signals(signum).name:
            raise KeyboardInterrupt
        self._received = signal.Signals(signum).name

    def requested(self) -> bool:
        """True on every rank once any rank received a signal (a vote of all ranks)."""
        flag = self._received is not None
        if dist.is_initialized():
            t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
            self._received = self._received or ("SIGTERM" if flag else None)
        return flag

    def log(self, record: dict[str, Any]) -> None:
        self._vote_due = True  # every rank logs the same steps

    def should_stop(self) -> bool:
        if self._tighten is not None:
            mesh, seconds = self._tighten
            set_collective_timeout(mesh, seconds=seconds)
            self._tighten = None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self._received is not None
        due, self._vote_due = self._vote_due, False
        return self.requested() if due else False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route SIGTERM/SIGINT here (main thread only) and restore the old handlers after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
