"""The training loop: step seam, clipping, optimizer step, logging, checkpoints."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from llmforge.train.components import Components


@dataclass
class LoopHooks:
    """Side effects around the loop, each optional."""

    log: Callable[[dict], None] = lambda record: None
    progress: Callable[[int, Optional[float], Optional[float]], None] = lambda step, loss, tps: None
    checkpoint: Callable[[int], None] = lambda step: None
    should_stop: Callable[[], bool] = lambda: False
    validated: Callable[[int, float], None] = lambda step, val_loss: None
    after_step: Callable[[int], None] = lambda step: None


@dataclass
class LoopResult:
    last_step: int
    losses: List[float] = field(default_factory=list)
    stopped_early: bool = False
    val_loss: Optional[float] = None


def train_loop(c: Components, *, start_step: int, total_steps: int, grad_clip: float, log_interval: int, checkpoint_interval: int, hooks: LoopHooks, eval_interval: int = 0, eval_steps: int = 1) -> LoopResult:
    """Run optimizer steps ``start_step+1 .. total_steps`` (steps are 1-based, as logged).

    With ``c.val_sampler`` set, the validation loss is computed every
    ``eval_interval`` steps (0: never in between) and after the last step, and
    logged with that step's record."""
    result = LoopResult(last_step=start_step)
    for step in range(start_step + 1, total_steps + 1):
        started = time.perf_counter()
        batch = c.sampler.next_batch(dp_rank=c.rank.dp_rank, dp_size=c.rank.dp_size)
        out = c.step(batch)
        grad_norm = _unscale_and_clip(c, grad_clip)
        lr = c.scheduler.get_last_lr()[0]
        if c.scaler.update(found_inf=not math.isfinite(grad_norm)):
            c.optimizer.step()
        c.optimizer.zero_grad(set_to_none=True)
        c.scheduler.step()
        elapsed = time.perf_counter() - started
        tokens_per_s = c.tokens_per_step / elapsed
        result.losses.append(out.loss)
        result.last_step = step
        hooks.progress(step, out.loss, tokens_per_s)
        validate = c.val_sampler is not None and (step == total_steps or (eval_interval and step % eval_interval == 0))
        if step % log_interval == 0 or step == total_steps or validate:
            record = {"step": step, "loss": out.loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s, "step_time_s": elapsed}
            if c.scaler.enabled:
                record["loss_scale"] = c.scaler.scale
            record.update(out.metrics)
            record.update(c.extra_metrics())
            if validate:
                record.update(evaluate(c, steps=eval_steps))
                result.val_loss = record["val_loss"]
                hooks.validated(step, result.val_loss)
            hooks.log(record)
        hooks.after_step(step)
        stop = hooks.should_stop()
        if step == total_steps or stop or (checkpoint_interval and step % checkpoint_interval == 0):
            hooks.checkpoint(step)
        if stop:
            result.stopped_early = step < total_steps
            break
    return result


def evaluate(c: Components, *, steps: int) -> dict:
    """Mean loss over the next ``steps`` global batches of the held-out stream, and its perplexity."""
    total = 0.0
    for _ in range(steps):
        total += c.step.evaluate(c.val_sampler.next_batch(dp_rank=c.rank.dp_rank, dp_size=c.rank.dp_size))
    loss = total / steps
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700.0))}


def _unscale_and_clip(c: Components, grad_clip: float) -> float:
    factor = c.scaler.unscale_factor()
    if factor != 1.0:
        with torch.no_grad():
            for p in c.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
    return c.clip_grads(grad_clip)
