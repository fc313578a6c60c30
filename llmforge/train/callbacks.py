"""The parts of a run the training loop calls at fixed points of a step (in the spirit of
OLMo-core's trainer callbacks and torchtitan's ``Stateful`` components).

A step runs: the forward and backward, the guard's verdict, the optimizer step (or its
skip), then ``after_update``; on a logged step ``log`` with the step's record; then
``step_end``; then ``should_stop``, asked of every part (each may hold a collective, so
none is skipped); at a checkpoint, ``checkpoint_saved`` with what the save did. At the end
of the run ``close``, in the order the parts were given.

A part with a ``name`` keeps state in the checkpoint: its ``state_dict()`` (JSON values) is
saved under that name in ``train_state.json`` beside the components' own (scheduler,
sampler, loss scaler, the guard's counts), and ``load_state_dict`` gets it back on resume
(``llmforge.train.state``). The two methods make every part a
``torch.distributed.checkpoint.stateful.Stateful``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llmforge.checkpoint.store import SaveRecord


class Callback:
    """One part of a run; every hook does nothing unless overridden."""

    #: The key of this part's state in ``train_state.json`` ("": it keeps none).
    name: ClassVar[str] = ""

    def after_update(self, step: int) -> None:
        """Right after the optimizer step ``step`` (1-based), whether it updated or was skipped."""

    def log(self, record: dict[str, Any]) -> None:
        """A logged step's record (the line metrics.jsonl gets)."""

    def step_end(self, step: int) -> None:
        """After every step, once its record (if any) is logged."""

    def should_stop(self) -> bool:
        """True to end the run after this step (a checkpoint is saved first)."""
        return False

    def checkpoint_saved(self, record: SaveRecord) -> None:
        """A checkpoint was written (or, if async, started)."""

    def close(self) -> None:
        """The run is over (normally or not): flush and release what this part holds."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` returned at the checkpoint resumed from."""


@dataclass(frozen=True)
class Callbacks:
    """Several parts called as one, in order."""

    parts: tuple[Callback, ...] = ()

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.parts)

    def after_update(self, step: int) -> None:
        for part in self.parts:
            part.after_update(step)

    def log(self, record: dict[str, Any]) -> None:
        for part in self.parts:
            part.log(record)

    def step_end(self, step: int) -> None:
        for part in self.parts:
            part.step_end(step)

    def should_stop(self) -> bool:
        answers = [part.should_stop() for part in self.parts]  # every part asked: some agree across ranks
        return any(answers)

    def checkpoint_saved(self, record: SaveRecord) -> None:
        for part in self.parts:
            part.checkpoint_saved(record)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def named(parts: Iterable[Callback]) -> dict[str, Callback]:
    """The parts that keep state, by name (two parts may not share one)."""
    out: dict[str, Callback] = {}
    for part in parts:
        if not part.name:
            continue
        if part.name in out:
            raise ValueError(f"two run parts keep their state under the name {part.name!r}")
        out[part.name] = part
    return out


@dataclass
class Recorder(Callback):
    """Keeps every logged record (the tests' and harness's view of a run)."""

    records: list[dict[str, Any]] = field(default_factory=list)

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
