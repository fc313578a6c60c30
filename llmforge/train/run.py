"""One rank's whole run: data, components, resume, loop, logging, checkpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console

from llmforge.checkpoint import store
from llmforge.plan import RunPlan
from llmforge.train.components import Components, RankInfo
from llmforge.train.loop import LoopHooks, LoopResult, train_loop


@dataclass
class RunSummary:
    first_loss: Optional[float]
    last_loss: Optional[float]
    last_step: int
    wall_s: float
    checkpoint: Optional[Path]


def prepare_data(plan: RunPlan, *, console: Console):
    from llmforge.data.prepare import prepare

    cfg = plan.config
    return prepare(data=cfg.data, vocab_size=plan.data_vocab_size, seed=cfg.train.seed, console=console)


def make_sampler(plan: RunPlan, prepared) -> object:
    from llmforge.data.sampler import BatchSampler

    cfg = plan.config
    return BatchSampler(prepared, seq_len=cfg.model.seq_len, global_batch_size=cfg.train.global_batch_size, seed=cfg.train.seed)


def build(plan: RunPlan, *, rank: RankInfo, console: Console) -> Components:
    prepared = prepare_data(plan, console=console)
    if prepared.vocab_size > plan.config.model.vocab_size:
        from llmforge.errors import fail

        raise fail(f"the tokenizer has {prepared.vocab_size} tokens but model.vocab_size={plan.config.model.vocab_size}; raise model.vocab_size or set data.vocab_size lower")
    sampler = make_sampler(plan, prepared)
    from llmforge.train.build import build_single_process

    return build_single_process(plan, rank=rank, sampler=sampler)


def train_state(c: Components) -> dict:
    return {"scheduler": c.scheduler.state_dict(), "sampler": c.sampler.state_dict(), "scaler": c.scaler.state_dict()}


def restore(c: Components, *, path: Path) -> int:
    state = store.load(path=path, model_parts=c.model_parts, optimizer=c.optimizer)
    c.scheduler.load_state_dict(state["scheduler"])
    c.sampler.load_state_dict(state["sampler"])
    c.scaler.load_state_dict(state["scaler"])
    return int(state["step"])


def run(plan: RunPlan, *, rank: RankInfo, resume_from: Optional[Path] = None, console: Optional[Console] = None) -> RunSummary:
    console = console or Console(stderr=True)
    cfg = plan.config
    started = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    c = build(plan, rank=rank, console=console)
    start_step = restore(c, path=resume_from) if resume_from is not None else 0
    run_dir = plan.run_dir
    if rank.is_main:
        plan.save(run_dir / "plan.json")
    saved: list[Path] = []
    hooks, closers = _hooks(plan, c, rank=rank, start_step=start_step, console=console, saved=saved)
    try:
        result: LoopResult = train_loop(
            c,
            start_step=start_step,
            total_steps=cfg.train.steps,
            grad_clip=cfg.optim.grad_clip,
            log_interval=cfg.train.log_interval,
            checkpoint_interval=cfg.checkpoint.interval,
            hooks=hooks,
        )
    finally:
        for close in closers:
            close()
    return RunSummary(
        first_loss=result.losses[0] if result.losses else None,
        last_loss=result.losses[-1] if result.losses else None,
        last_step=result.last_step,
        wall_s=time.perf_counter() - started,
        checkpoint=saved[-1] if saved else None,
    )


def _hooks(plan: RunPlan, c: Components, *, rank: RankInfo, start_step: int, console: Console, saved: list):
    from llmforge.observe.console import TrainingProgress
    from llmforge.observe.metrics import MetricsFile
    from llmforge.observe.wandb_run import WandbRun

    cfg = plan.config
    closers = []
    hooks = LoopHooks()
    root = plan.run_dir / "checkpoints"

    def checkpoint(step: int) -> None:
        if step == cfg.train.steps and not cfg.checkpoint.save_final and not (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0):
            return
        saved.append(store.save(root=root, step=step, model_parts=c.model_parts, optimizer=c.optimizer, train_state=train_state(c)))

    hooks.checkpoint = checkpoint
    if not rank.is_main:
        return hooks, closers
    metrics = MetricsFile(plan.run_dir / "metrics.jsonl")
    wandb_run = WandbRun(settings=cfg.logging.wandb, run_dir=plan.run_dir, name=cfg.run.name, config=plan.to_dict(), resume_id=None)
    progress = TrainingProgress(total_steps=cfg.train.steps, start_step=start_step, enabled=cfg.logging.console, console=console)

    def log(record: dict) -> None:
        metrics.write(record)
        wandb_run.log(record, step=record["step"])

    hooks.log = log
    hooks.progress = lambda step, loss, tps: progress.update(step=step, loss=loss, tokens_per_s=tps)
    closers += [progress.close, metrics.close, wandb_run.finish]
    return hooks, closers
