"""Activations saved for backward, kept in host memory (``parallel.offload_activations``).

A saved-tensors hook (``torch.autograd.graph.saved_tensors_hooks``) copies each
activation autograd saves in forward to host memory and copies it back when backward
needs it, as ``torch.autograd.graph.save_on_cpu`` does, with the copy down overlapped:
on a GPU it runs on a side stream into pinned memory, so forward goes on while it
runs (the activation's device memory is released once the copy is done). The copy
back runs on the compute stream when backward reaches the tensor (not prefetched).
Parameters are not copied (backward reads them where they are); FSDP2's states
offload (``CPUOffloadPolicy``) is ``llmforge.parallel.data``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class ActivationOffload:
    """The pack and unpack hooks for tensors saved on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any | None = torch.cuda.Stream(device) if device.type == "cuda" else None

    def pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter) or tensor.device.type != self.device.type:
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=self.stream is not None)
        if self.stream is None:
            host.copy_(tensor)
            return (tensor.device, host, None)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensor.record_stream(self.stream)  # its memory is reused only once the copy is done
        return (tensor.device, host, done)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        if done is None:
            return host.to(device)
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


class OffloadedStep:
    """A step runner whose forward saves its activations in host memory (``ActivationOffload``)."""

    def __init__(self, inner: Any, *, device: torch.device) -> None:
        self.inner = inner
        self.offload = ActivationOffload(device)

    def __call__(self, batch: torch.Tensor) -> Any:
        with self.offload.active():
            return self.inner(batch)

    def evaluate(self, batch: torch.Tensor) -> float:
        return self.inner.evaluate(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
