"""The fake world a rehearsal runs in: torch's fake process group, fake tensors, fake batches.

Three seams keep the project's own build path usable on fake tensors, each only while a
rehearsal runs (``fake_world``):

- ``RehearsalMode``: ops whose tensor inputs are all real (the mesh's rank table, read
  with ``tolist`` when groups are made) run for real; everything else is fake.
- ``nn.Module.to`` / ``to_empty`` replace each parameter with ``torch.utils.swap_tensors``,
  which refuses a tensor that has a weak reference. Every FakeTensor an op returns is
  weakly referenced by the fake mode's memo (meta tensor -> fake tensor, a cache), so
  moving a module built on fake tensors fails. While rehearsing, swap_tensors' check
  ignores those memo references (``weakref.KeyedRef``); other weak references still refuse.
- Pipeline stages vote on whether every stage of the pipeline was given its shapes (a
  tensor passed along the pipeline and back, read with ``item``); over the fake group no
  neighbour answers. Every stage llmforge builds is given its shapes
  (``llmforge.parallel.pipeline.StageShapes``), so the vote's answer is known: static.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.utils
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten


class RehearsalMode(FakeTensorMode):
    """Fake tensors for everything the program makes; ops on real tensors only stay real."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _WeakrefsBesidesFakeMemo:
    """``weakref`` as ``torch.utils.swap_tensors`` sees it during a rehearsal (module docstring)."""

    @staticmethod
    def getweakrefs(obj) -> list:
        return [r for r in weakref.getweakrefs(obj) if not isinstance(r, weakref.KeyedRef)]


@contextlib.contextmanager
def _movable_fake_modules() -> Iterator[None]:
    original = torch.utils.weakref
    torch.utils.weakref = _WeakrefsBesidesFakeMemo()  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.utils.weakref = original


def _static_stages(_schedule, stages, has_backward: bool, _p2p_done: bool) -> None:
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
            raise RuntimeError(f"pipeline stage {stage.stage_index} was built without its shapes: a rehearsal cannot infer them")
        stage._inference_mode = InferenceMode.STATIC


@contextlib.contextmanager
def _stages_without_vote() -> Iterator[None]:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    original = _PipelineSchedule._warmup_p2p
    _PipelineSchedule._warmup_p2p = _static_stages  # type: ignore[method-assign]
    try:
        yield
    finally:
        _PipelineSchedule._warmup_p2p = original  # type: ignore[method-assign]


@contextlib.contextmanager
def fake_process_group(*, rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group as the default group: this process is ``rank`` of ``world_size``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs a process without a process group")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors() -> Iterator[RehearsalMode]:
    """Fake tensors (``RehearsalMode``), modules that can move while on them, pipeline stages that do not vote."""
    with _movable_fake_modules(), _stages_without_vote(), RehearsalMode() as mode:
        yield mode


class FakeBatches:
    """Token batches of the plan's shape (this data-parallel rank's rows, ``seq_len + 1``
    tokens each), made under the fake mode: no corpus is read."""

    def __init__(self, *, global_batch: int, seq_len: int, vocab_size: int, eos_id=None) -> None:
        self.global_batch, self.seq_len, self.vocab_size, self.eos_id = global_batch, seq_len, vocab_size, eos_id

    def next_batch(self, *, dp_rank: int, dp_size: int) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (self.global_batch // dp_size, self.seq_len + 1))
