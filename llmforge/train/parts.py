"""A rank's run parts around the loop, built once the run knows its starting step: the
writers of rank 0 (``llmforge.train.observers``), the profiler, the fault drills, the stop
signal, and the checkpointer that saves every stateful part the same way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from llmforge.checkpoint import store
from llmforge.observe.events import EventLog
from llmforge.observe.profile import MemorySnapshots
from llmforge.plan import RunPlan
from llmforge.train.callbacks import Callback, Callbacks, named
from llmforge.train.compile_watch import compile_watch
from llmforge.train.components import Components
from llmforge.train.downstream import DownstreamEval
from llmforge.train.instrument import inject_fault, node_loss, profiler
from llmforge.train.loop import LoopResult, train_loop
from llmforge.train.observers import observers
from llmforge.train.state import Checkpointer, load_train_state, stateful_parts
from llmforge.train.stop import StopSignal
from llmforge.train.stragglers import straggler_report


@dataclass(frozen=True)
class RunParts:
    """The run parts the loop calls (``callbacks``, in order), the stop signal among them, and
    the checkpointer with its saver and event log."""

    callbacks: Callbacks
    stop: StopSignal
    checkpointer: Checkpointer
    saver: store.CheckpointSaver
    events: EventLog
    #: The run's downstream evaluations (``eval.interval``), or None.
    downstream: Callable[[int], dict] | None = None

    def loop(self, plan: RunPlan, c: Components) -> Callable[[int], LoopResult]:
        """The plan's training loop from a step to ``train.steps``, with these parts."""
        t = plan.config.train

        def from_step(start: int) -> LoopResult:
            return train_loop(
                c,
                start_step=start,
                total_steps=t.steps,
                grad_clip=plan.config.optim.grad_clip,
                log_interval=t.log_interval,
                checkpoint_interval=plan.checkpoint_interval,
                callbacks=self.callbacks,
                save=self.checkpointer,
                eval_interval=t.eval_interval,
                eval_steps=t.eval_steps,
                downstream=self.downstream,
                downstream_interval=plan.config.eval.interval,
            )

        return from_step

    def restore(self, state: Mapping[str, Any]) -> None:
        """Give the parts that keep state theirs from a checkpoint's train state."""
        load_train_state(named(self.callbacks), state)

    def close(self) -> None:
        """Every part in order, then the saver (its background save finished) and the event log."""
        try:
            self.callbacks.close()
        finally:
            self.saver.close()
            self.events.close()


def run_parts(
    plan: RunPlan, c: Components, *, start_step: int, snapshots: MemorySnapshots, console: Console, estimate_s: float = 0.0
) -> tuple[Components, RunParts]:
    """This rank's run parts (the components again: a fault drill may poison their step);
    ``estimate_s``: the estimated step time the straggler report compares with."""
    cfg, rank = plan.config, c.rank
    c, fault = inject_fault(c)
    stop = StopSignal(device=rank.device, mesh=rank.mesh, timeout_s=cfg.cluster.timeout_s)
    parts: list[Callback] = straggler_report(plan, rank=rank, start_step=start_step, estimate_s=estimate_s, console=console)
    parts += observers(plan, c, start_step=start_step, console=console) if rank.is_main else []
    parts += profiler(plan, snapshots=snapshots, rank=rank, start_step=start_step, console=console)
    parts += compile_watch(plan, is_main=rank.is_main, console=console)
    parts += [*fault, *node_loss(), stop]
    callbacks = Callbacks(tuple(parts))
    events = EventLog(plan.run_dir / "events.log")
    saver = store.CheckpointSaver(
        root=plan.checkpoint_root,
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
        rank=rank.rank,
        log=events.write,
        run_dir=plan.run_dir,
    )

    def due(step: int) -> bool:
        """At intervals, at the end (checkpoint.save_final) and when stopped by a signal."""
        interval_hit = bool(plan.checkpoint_interval) and step % plan.checkpoint_interval == 0
        return step != cfg.train.steps or cfg.checkpoint.save_final or interval_hit or stop.received is not None

    checkpointer = Checkpointer(c, saver=saver, plan=plan.to_dict(), parts=stateful_parts(c, callbacks), callbacks=callbacks, due=due)
    downstream = None
    if cfg.eval.interval > 0 and cfg.eval.tasks:
        downstream = DownstreamEval(plan, c, console=console)
    return c, RunParts(callbacks=callbacks, stop=stop, checkpointer=checkpointer, saver=saver, events=events, downstream=downstream)
