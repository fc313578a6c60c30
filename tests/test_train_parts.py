"""The trainer's run parts (llmforge.train.callbacks): when the loop calls them, and how a
checkpoint keeps every stateful part by name (llmforge.train.state)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from llmforge.checkpoint.store import CheckpointSaver
from llmforge.testing.harness import SyntheticSampler, tiny_plan
from llmforge.train.build import build_components
from llmforge.train.callbacks import Callback, Callbacks, Recorder, named
from llmforge.train.components import RankInfo
from llmforge.train.loop import train_loop
from llmforge.train.run import restore
from llmforge.train.state import Checkpointer, load_train_state, stateful_parts


class Counter(Callback):
    """Counts optimizer steps; keeps the count in the checkpoint."""

    name = "counter"

    def __init__(self) -> None:
        self.updates = 0

    def after_update(self, step: int) -> None:
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])


class Calls(Callback):
    """Writes down every hook the loop calls, in order; asks to stop after ``stop_at``."""

    def __init__(self, calls: list, tag: str, stop_at: int | None = None) -> None:
        self.calls, self.tag, self.stop_at, self.step = calls, tag, stop_at, 0

    def after_update(self, step: int) -> None:
        self.calls.append((self.tag, "after_update", step))

    def log(self, record: dict) -> None:
        self.calls.append((self.tag, "log", record["step"]))

    def step_end(self, step: int) -> None:
        self.step = step
        self.calls.append((self.tag, "step_end", step))

    def should_stop(self) -> bool:
        self.calls.append((self.tag, "should_stop", self.step))
        return self.stop_at is not None and self.step >= self.stop_at

    def checkpoint_saved(self, record) -> None:
        self.calls.append((self.tag, "checkpoint_saved", record.step))


def _components(plan):
    cfg = plan.config
    torch.manual_seed(cfg.train.seed)
    sampler = SyntheticSampler(
        vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len, global_batch_size=cfg.train.global_batch_size, seed=cfg.train.seed
    )
    return build_components(plan, rank=RankInfo(), sampler=sampler)


@pytest.fixture(scope="module")
def plan():
    return tiny_plan(["train.steps=4", "model.num_layers=1"])


def test_the_loop_calls_every_part_at_each_point_of_a_step_and_asks_all_of_them_to_stop(plan, tmp_path):
    c = _components(plan)
    calls: list = []
    parts = [Calls(calls, "a", stop_at=3), Calls(calls, "b")]
    saver = CheckpointSaver(root=tmp_path, keep=2, async_save=False, rank=0, log=lambda text: None)
    save = Checkpointer(c, saver=saver, plan=plan.to_dict(), parts=stateful_parts(c), callbacks=Callbacks(tuple(parts[:1])))
    result = train_loop(c, start_step=0, total_steps=4, grad_clip=1.0, log_interval=2, checkpoint_interval=0, callbacks=parts, save=save)
    saver.close()
    assert result.last_step == 3 and result.stopped_early
    a = [(hook, step) for tag, hook, step in calls if tag == "a"]
    assert a == [
        *[("after_update", 1), ("step_end", 1), ("should_stop", 1)],
        *[("after_update", 2), ("log", 2), ("step_end", 2), ("should_stop", 2)],
        *[("after_update", 3), ("step_end", 3), ("should_stop", 3), ("checkpoint_saved", 3)],
    ]
    assert ("b", "should_stop", 3) in calls  # the second part is asked though the first said stop (each may hold a collective)
    assert calls.index(("a", "after_update", 2)) < calls.index(("b", "after_update", 2)) < calls.index(("a", "log", 2))


def test_every_stateful_part_is_saved_under_its_name_and_restored(plan, tmp_path, capsys):
    c, counter = _components(plan), Counter()
    saver = CheckpointSaver(root=tmp_path, keep=2, async_save=False, rank=0, log=lambda text: None)
    save = Checkpointer(c, saver=saver, plan=plan.to_dict(), parts=stateful_parts(c, [counter, Recorder()]))
    train_loop(c, start_step=0, total_steps=3, grad_clip=1.0, log_interval=1, checkpoint_interval=0, callbacks=[counter], save=save)
    saver.close()
    state = json.loads((tmp_path / "step_3" / "train_state.json").read_text())
    assert set(state) == {"step", "scheduler", "sampler", "scaler", "anomaly", "counter"}  # the components' keys as before, and the part's
    assert state["counter"] == {"updates": 3} and state["sampler"] == c.sampler.state_dict()

    fresh, again = _components(plan), Counter()
    restored = restore(fresh, path=tmp_path / "step_3", console=None)  # type: ignore[arg-type]
    load_train_state(named([again]), restored.state)
    assert restored.step == 3 and again.updates == 3
    assert fresh.scheduler.last_epoch == 3 and fresh.sampler.state_dict() == c.sampler.state_dict()


def test_a_checkpoint_without_a_parts_state_leaves_it_as_built(plan):
    c, counter = _components(plan), Counter()
    counter.updates = 7
    parts = stateful_parts(c, [counter])
    guard_before = c.guard.state_dict()
    load_train_state(parts, {"step": 5, "scheduler": c.scheduler.state_dict(), "sampler": c.sampler.state_dict()})  # an older checkpoint
    assert counter.updates == 7 and c.guard.state_dict() == guard_before


def test_two_parts_may_not_keep_state_under_one_name(plan):
    c = _components(plan)
    with pytest.raises(ValueError, match="counter"):
        stateful_parts(c, [Counter(), Counter()])

    class Clash(Counter):
        name = "scheduler"

    with pytest.raises(ValueError, match="scheduler"):
        stateful_parts(c, [Clash()])


def test_components_are_built_once_and_never_changed(plan):
    c = _components(plan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.step = None  # type: ignore[misc]
