"""The training loop: step seam, clipping, the guarded optimizer step, the run parts' hooks, checkpoints."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from llmforge.parallel.dtensor import local
from llmforge.processes.progress import mark, reporter
from llmforge.train.anomaly import Reading
from llmforge.train.callbacks import Callback, Callbacks
from llmforge.train.components import Components


@dataclass
class LoopResult:
    """``losses``: the logged steps' losses; ``first_loss``/``last_loss``: of the first and
    last step run; ``step_times``: the mean step time of each logged window;
    ``measured``: the meter's last reading (MFU, peak memory)."""

    last_step: int
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    measured: dict = field(default_factory=dict)
    stopped_early: bool = False
    val_loss: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    #: Seconds each downstream evaluation (eval.interval) took.
    eval_seconds: list[float] = field(default_factory=list)


@dataclass
class _Window:
    """The steps since the last log: their mean time is what a log reports."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0

    def close(self) -> float:
        now = time.perf_counter()
        elapsed = (now - self.start) / max(1, self.steps)
        self.start, self.steps = now, 0
        return elapsed


def train_loop(
    c: Components,
    *,
    start_step: int,
    total_steps: int,
    grad_clip: float,
    log_interval: int,
    checkpoint_interval: int,
    callbacks: Iterable[Callback] = (),
    save: Callable[[int], None] | None = None,
    eval_interval: int = 0,
    eval_steps: int = 1,
    downstream: Callable[[int], dict] | None = None,
    downstream_interval: int = 0,
) -> LoopResult:
    """Run optimizer steps ``start_step+1 .. total_steps`` (steps are 1-based, as logged).

    A step queues its work and never waits for the device: loss and gradient norm
    stay device tensors, read back once (one synchronisation) at each logged step.
    ``c.guard`` checks every step for a non-finite loss or gradient norm on the device
    and ``c.update`` skips its update there; the guard's flags come back with the logged step's
    read (and before a checkpoint), when it raises ``llmforge.train.anomaly.Anomaly`` if its policy
    says stop or roll back. Step time and tokens/s are averaged over the steps since the previous log.
    With ``c.val_sampler`` set, the validation loss is computed every
    ``eval_interval`` steps (0: never in between) and after the last step, and
    logged with that step's record; ``downstream(step)`` (the tasks of ``llmforge.train.downstream``)
    every ``downstream_interval`` steps, likewise. ``c.callbacks`` and then ``callbacks`` are called at the
    points ``llmforge.train.callbacks`` names; ``save(step)`` writes a checkpoint at every
    ``checkpoint_interval`` steps, after the last step and when a part asks to stop."""
    parts = Callbacks((*c.callbacks, *callbacks))
    result = LoopResult(last_step=start_step)
    first: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    window = _Window()
    for step in range(start_step + 1, total_steps + 1):
        mark("data", step=step)
        c.before_step(step)
        batch = c.sampler.next_batch(dp_rank=c.rank.dp_rank, dp_size=c.rank.dp_size)
        mark("forward")
        out = c.step(batch)
        mark("optimizer")
        flags = c.guard.local_flags(out.loss)
        grad_norm = _unscale_and_clip(c, grad_clip, flags=flags)
        lr = c.scheduler.get_last_lr()[0]
        c.update(c.guard.verdict(step=step, loss=out.loss, grad_norm=grad_norm, flags=flags))  # skipped on the device when not ok
        parts.after_update(step)
        c.optimizer.zero_grad(set_to_none=True)
        c.scheduler.step()
        mark("log")
        loss, window.steps = out.loss, window.steps + 1
        first = loss if first is None else first
        result.last_step = step
        validate = c.val_sampler is not None and (step == total_steps or (eval_interval and step % eval_interval == 0))
        tasks = downstream is not None and downstream_interval > 0 and step % downstream_interval == 0
        logged = step % log_interval == 0 or step == total_steps or validate or tasks
        if logged:
            record = _record(c, result, step=step, reading=c.guard.read(), lr=lr, elapsed=window.close(), metrics=out.metrics)
            if validate:
                mark("eval")
                record.update(evaluate(c, steps=eval_steps))
                result.val_loss = record["val_loss"]
            if tasks:
                record.update(downstream(step))  # type: ignore[misc]
                result.eval_seconds.append(record["eval_s"])
            if validate or tasks:
                window.start = time.perf_counter()  # the next window times training steps, not these evaluations
            parts.log(record)
            c.guard.decide(step)
        parts.step_end(step)
        stop = parts.should_stop()
        if step == total_steps or stop or (checkpoint_interval and step % checkpoint_interval == 0):
            mark("checkpoint")
            _checkpoint(c, save, step=step, read=not logged)
        reporter.step_done()
        if stop:
            result.stopped_early = step < total_steps
            break
    mark("done")
    if loss is not None:
        result.first_loss, result.last_loss = torch.stack([first.double(), loss.double()]).tolist()
    return result


def _checkpoint(c: Components, save: Callable[[int], None] | None, *, step: int, read: bool) -> None:
    """Save, once the steps since the last read are known to be fine (``save`` checks the weights)."""
    if read:
        c.guard.read()
        c.guard.decide(step)
    if save is not None:
        save(step)


def _record(c: Components, result: LoopResult, *, step: int, reading: Reading, lr: float, elapsed: float, metrics: dict) -> dict:
    """A logged step's record, from the guard's one read of the device."""
    loss_value, norm_value = reading.loss, reading.grad_norm
    result.losses.append(loss_value)
    result.step_times.append(elapsed)
    record = {
        "step": step,
        "loss": loss_value,
        "lr": lr,
        "grad_norm": norm_value,
        "tokens_per_s": c.tokens_per_step / elapsed,
        "step_time_s": elapsed,
    }
    record.update(reading.metrics)
    if c.meter is not None:
        result.measured = c.meter(elapsed)
        record.update(result.measured)
    if c.scaler.enabled:
        record["loss_scale"] = c.scaler.scale
    record.update(metrics)
    record.update(c.extra_metrics())
    return record


def evaluate(c: Components, *, steps: int) -> dict:
    """Mean loss over the next ``steps`` global batches of the held-out stream, and its perplexity;
    with a mixture also ``val_loss/NAME`` of each dataset over its first ``steps`` held-out batches
    (the same sequences at every validation, so the series compares like with like)."""
    loss = _mean_loss(c, c.val_sampler, steps=steps)
    record = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}
    for name, sampler in c.val_sources:
        sampler.position = 0
        record[f"val_loss/{name}"] = _mean_loss(c, sampler, steps=steps)
    return record


def _mean_loss(c: Components, sampler, *, steps: int) -> float:
    total = 0.0
    for _ in range(steps):
        total += c.step.evaluate(sampler.next_batch(dp_rank=c.rank.dp_rank, dp_size=c.rank.dp_size))
    return total / steps


def _unscale_and_clip(c: Components, grad_clip: float, *, flags: torch.Tensor) -> torch.Tensor:
    factor = c.scaler.unscale_factor()
    if factor != 1.0:
        with torch.no_grad():
            grads = [p.grad for p in c.parameters() if p.grad is not None]
            locals_ = [local(g) for g in grads]
            if locals_:
                torch._foreach_mul_(locals_, factor)
    return c.clip_grads(grad_clip, flags=flags)
