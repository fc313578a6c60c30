"""The train state a checkpoint keeps beside the model and optimizer (``train_state.json``):
every stateful part of a run saved and loaded the same way, by name.

The parts are the components' own (``Components.stateful_parts``: ``scheduler``,
``sampler``, ``scaler``, ``anomaly``, ``val_sampler`` when the run validates) and the run
parts with a ``name`` (``llmforge.train.callbacks``). A part a checkpoint does not hold
(an older checkpoint, a part new since) keeps the state it was built with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from llmforge.checkpoint import store
from llmforge.train.callbacks import Callback, Callbacks, named
from llmforge.train.components import Components
from llmforge.train.recovery import check_and_save


def stateful_parts(c: Components, callbacks: Iterable[Callback] = ()) -> dict[str, Stateful]:
    """Every part whose state a checkpoint keeps, by its key in ``train_state.json``."""
    parts = c.stateful_parts()
    for name, part in named(callbacks).items():
        if name in parts:
            raise ValueError(f"a run part keeps its state under {name!r}, which a component has")
        parts[name] = part
    return parts


def train_state(parts: Mapping[str, Stateful]) -> dict[str, Any]:
    """The JSON part of a checkpoint: each part's ``state_dict()`` under its name."""
    return {name: part.state_dict() for name, part in parts.items()}


def load_train_state(parts: Mapping[str, Stateful], state: Mapping[str, Any]) -> None:
    """Give each part its saved state (a part the checkpoint does not hold keeps its own)."""
    for name, part in parts.items():
        if name in state:
            part.load_state_dict(state[name])


class Checkpointer:
    """Saves a checkpoint of finite weights when ``due(step)`` says so: model, optimizer and
    the train state of ``parts``; then tells ``callbacks`` what the save did."""

    def __init__(
        self,
        c: Components,
        *,
        saver: store.CheckpointSaver,
        plan: dict[str, Any],
        parts: Mapping[str, Stateful],
        callbacks: Callbacks | None = None,
        due: Callable[[int], bool] = lambda step: True,
    ) -> None:
        self.c, self.saver, self.plan, self.parts, self.due = c, saver, plan, parts, due
        self.callbacks = callbacks if callbacks is not None else Callbacks()

    def __call__(self, step: int) -> None:
        if not self.due(step):
            return
        check_and_save(self.c, self.saver, step=step, train_state=train_state(self.parts), plan=self.plan)
        self.callbacks.checkpoint_saved(self.saver.records[-1])
