"""One rank's whole run: build (data, components), restore (a checkpoint's state into every
stateful part), loop (with the run parts: ``llmforge.train.parts``), close.

On SIGTERM or SIGINT (preemption, Ctrl-C) the current step finishes, a
checkpoint is saved, the resume command is printed, and the run returns
normally (exit code 0). A second signal of the same kind stops at once
(``llmforge.train.stop``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.text import Text

from llmforge.calibrate.advice import profile_warning
from llmforge.checkpoint import store
from llmforge.checkpoint.hf_import import load_hf_weights
from llmforge.checkpoint.state import load_rng
from llmforge.data.apart import prepare_apart
from llmforge.data.prepare import document_ends_for
from llmforge.data.sampler import BatchSampler
from llmforge.errors import fail, pasteable
from llmforge.estimate.core import Estimate, estimate_plan
from llmforge.estimate.text import gib
from llmforge.evaluate.results import drop_results_after
from llmforge.observe.metrics import tidy_metrics
from llmforge.observe.profile import MemorySnapshots
from llmforge.plan import RunPlan
from llmforge.processes.host_memory import return_freed_memory
from llmforge.rundir import write_plan
from llmforge.train.build import build_components
from llmforge.train.components import Components, RankInfo
from llmforge.train.instrument import explain_oom
from llmforge.train.loop import LoopResult
from llmforge.train.meter import measured_peak_bytes, reset_peak_rss
from llmforge.train.optim import set_lr_scale
from llmforge.train.parts import run_parts
from llmforge.train.recovery import train_recovering
from llmforge.train.state import load_train_state


@dataclass
class RunSummary:
    first_loss: float | None
    last_loss: float | None
    last_step: int
    wall_s: float
    checkpoint: Path | None
    stopped_early: bool = False
    #: Measured step time (median of the logged windows after the first) and peak memory of this rank
    #: (of the most-loaded rank once ``with_most_loaded_peak`` gathered it).
    step_time_s: float | None = None
    peak_memory_bytes: float | None = None
    val_loss: float | None = None
    #: Steps skipped on non-finite numbers (train.anomaly; the run's whole count, across resumes) and rollbacks in this launch.
    skipped_steps: int = 0
    rollbacks: int = 0
    #: The run's one estimate (the launcher's, or this rank's), which the closing line compares with.
    estimate: Estimate | None = None
    #: Seconds each downstream evaluation of this launch took (eval.interval).
    eval_seconds: tuple[float, ...] = ()

    def describe(self, plan: RunPlan) -> Text:
        """The closing line a launcher prints (only "done" is styled; paths print as written):
        losses, files, and the measured step time and peak memory as ratios to the estimate."""
        losses = f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}" if self.first_loss is not None else "no steps left to train"
        if self.val_loss is not None:
            losses += f", val_loss {self.val_loss:.4f}"
        if self.skipped_steps:
            losses += (
                f"; {self.skipped_steps} step(s) skipped on non-finite numbers (train.anomaly, the skipped_steps column of metrics.jsonl)"
            )
        if self.rollbacks:
            losses += f"; {self.rollbacks} rollback(s)"
        if self.eval_seconds:
            spent = sum(self.eval_seconds)
            losses += (
                f"; {len(self.eval_seconds)} evaluation(s) of eval.tasks, {spent / len(self.eval_seconds):.2f} s each "
                f"({spent / max(self.wall_s, 1e-9):.0%} of the run)"
            )
        where = f"; checkpoint {self.checkpoint}" if self.checkpoint else ""
        rest = f" {plan.layout} step {self.last_step}: {losses} in {self.wall_s:.1f}s; metrics in {plan.run_dir / 'metrics.jsonl'}{where}"
        return Text.assemble(("done", "bold green"), rest + self.against_estimate(plan))

    def against_estimate(self, plan: RunPlan) -> str:
        """'; measured/estimate: step time 1.12x (...), peak memory 0.97x (...)' or ''."""
        if self.step_time_s is None:
            return ""
        est = self.estimate if self.estimate is not None else estimate_plan(plan)
        parts = [f"step time {self.step_time_s / est.step_s:.2f}x ({self.step_time_s:.3g} s vs {est.step_s:.3g} s)"]
        if self.peak_memory_bytes:
            expected = est.worst.total - (est.job.profile.runtime_reserved_bytes if plan.config.cluster.accelerator != "cpu" else 0)
            parts.append(f"peak memory {self.peak_memory_bytes / expected:.2f}x ({gib(self.peak_memory_bytes)} vs {gib(expected)})")
        p = est.job.profile
        warning = profile_warning(
            ratio=self.step_time_s / est.step_s,
            mfu=est.mfu * est.step_s / self.step_time_s,
            accelerator=plan.config.cluster.accelerator,
            source=p.source,
            calibration=dict(p.calibration),
        )
        return "; measured/estimate: " + ", ".join(parts) + warning


def with_most_loaded_peak(summary: RunSummary, *, device: torch.device) -> RunSummary:
    """``summary`` with the largest peak memory of any rank, the figure the estimate's
    most-loaded rank stands for (on a pipeline, rank 0 is rarely it). Collective."""
    peak = torch.tensor([summary.peak_memory_bytes or 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dataclasses.replace(summary, peak_memory_bytes=float(peak.item()) or None)


def prepare_data(plan: RunPlan, *, console: Console):
    """Tokenized data for the plan (prepared once, in a child process, then reused from the cache)."""
    cfg = plan.config
    return prepare_apart(data=cfg.data, vocab_size=plan.data_vocab_size, seed=cfg.train.seed, console=console)


def make_sampler(plan: RunPlan, prepared, *, split: str = "train", only_stream: int | None = None) -> object:
    """The resumable sampler of the global batch order (``split="val"``: of the held-out documents;
    ``only_stream``: of one dataset of a mixture alone)."""
    cfg = plan.config
    return BatchSampler(
        prepared,
        seq_len=cfg.model.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.train.seed,
        split=split,
        val_fraction=cfg.data.val_fraction,
        val_seed=cfg.data.val_seed,
        only_stream=only_stream,
    )


def build(plan: RunPlan, *, rank: RankInfo, console: Console, estimate: Estimate | None = None) -> Components:
    """Data and this rank's components (any layout). On a CPU the peak resident memory
    the closing line reads starts here, from a trimmed heap (``start_host_peak``)."""
    prepared = prepare_data(plan, console=console)
    if rank.device.type == "cpu":
        start_host_peak()
    if prepared.vocab_size > plan.config.model.vocab_size:
        raise fail(
            f"the tokenizer has {prepared.vocab_size} tokens but model.vocab_size={plan.config.model.vocab_size}; "
            "raise model.vocab_size or set data.vocab_size lower"
        )
    sampler = make_sampler(plan, prepared)
    val_sampler = _val_sampler(plan, prepared, train=sampler, console=console if rank.is_main else None)
    c = build_components(plan, rank=rank, sampler=sampler, val_sampler=val_sampler, estimate=estimate)
    if val_sampler is None or len(prepared.streams) < 2:
        return c
    sources = tuple((info.name, make_sampler(plan, prepared, split="val", only_stream=i)) for i, info in enumerate(prepared.streams))
    return dataclasses.replace(c, val_sources=sources)


def start_host_peak() -> None:
    """Give back what the process freed before the run (data preparation, a calibration in
    the launcher's process) and start the peak resident memory from what it holds now."""
    return_freed_memory()
    reset_peak_rss()


def _val_sampler(plan: RunPlan, prepared, *, train, console: Console | None):
    """The held-out stream, or None: validation off, or data too small to hold documents out (said once)."""
    fraction = plan.config.data.val_fraction
    if fraction <= 0:
        return None
    if all(train.held_out_documents):
        return make_sampler(plan, prepared, split="val")
    if console is not None:
        console.print(
            f"no validation: the data is too small to hold out documents (data.val_fraction={fraction}, see "
            "llmforge keys data.val_fraction); data.val_fraction=0 silences this",
            style="yellow",
            markup=False,
            highlight=False,
        )
    return None


@dataclass(frozen=True)
class Restored:
    """What a resume starts from: the checkpoint's step and its train state (``train_state.json``)."""

    step: int
    state: dict[str, Any]


def restore(c: Components, *, path: Path, console: Console) -> Restored:
    """Load a checkpoint into built components (resharding as needed).

    The learning-rate schedule continues at the saved step but follows this
    plan's lr and length, so ``train.lr``/``train.steps`` overrides apply (times the
    factor of the rollbacks before the save, ``train.rollback_lr_factor``)."""
    state = store.load(path=path, model_parts=c.model_parts, optimizer=c.optimizer)
    load_train_state(c.stateful_parts(), state)
    set_lr_scale(c.optimizer, c.scheduler, scale=c.guard.lr_scale)
    step = int(state["step"])
    if not load_rng(path, rank=c.rank.rank, world_size=c.rank.world_size):
        torch.manual_seed(_reseed(seed=state["sampler"].get("seed", 0), step=step, rank=c.rank.rank))
        if c.rank.is_main:
            console.print("the layout changed: random streams (dropout) restart from a seed derived from the step", style="yellow")
    return Restored(step=step, state=state)


def _reseed(*, seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + rank) % (2**63)


def set_aside_newer(root: store.Where, *, after_step: int) -> list[str]:
    """Rename checkpoints past the resumed step (another history) so ``latest`` never picks them; return their names."""
    moved = []
    for path in store.step_dirs(root):
        if store.step_of(path) > after_step:
            store.set_aside(path, name=f"superseded-step_{store.step_of(path)}")
            moved.append(f"step_{store.step_of(path)}")
    return moved


def _open_run_dir(plan: RunPlan, *, resumed: bool, start_step: int, console: Console) -> None:
    """plan.json, metrics.jsonl without an incomplete last line, and after a resume:
    metrics, evaluation results and checkpoints past the resumed step set aside (results removed)."""
    write_plan(plan)
    for note in tidy_metrics(plan.run_dir / "metrics.jsonl", after_step=start_step if resumed else None):
        console.print(note, style="yellow", markup=False, highlight=False)
    if not resumed:
        return
    drop_results_after(plan.run_dir, step=start_step)
    for old in set_aside_newer(plan.checkpoint_root, after_step=start_step):
        console.print(f"{old} is newer than the checkpoint resumed from; kept as superseded-{old}", style="yellow", markup=False)


def run(
    plan: RunPlan,
    *,
    rank: RankInfo,
    resume_from: Path | None = None,
    console: Console | None = None,
    restarted: bool = False,
    estimate: Estimate | None = None,
) -> RunSummary:
    """Train this rank from scratch or from ``resume_from`` to ``train.steps`` (or a stop signal).
    ``restarted``: a later attempt of the same job, whose metrics past its starting step are dropped.
    ``estimate``: the launcher's estimate of the plan, shared by the meter and the closing line
    (None: this rank estimates once, its prepared data's document lengths included)."""
    console = console or Console(stderr=True, markup=False, soft_wrap=True)
    started = time.perf_counter()
    torch.manual_seed(plan.config.train.seed)
    snapshots = MemorySnapshots(
        mode=plan.config.train.memory_snapshot, device=rank.device, out_dir=plan.run_dir / "profile", rank=rank.rank
    )
    built: list[Components] = []
    with explain_oom(plan, rank=rank, snapshots=snapshots, built=built):
        if estimate is None:
            estimate = estimate_plan(plan, documents=document_ends_for(plan.config, vocab_size=plan.data_vocab_size))
        c = build(plan, rank=rank, console=console, estimate=estimate)
        built.append(c)
        resumed = restore(c, path=resume_from, console=console) if resume_from is not None else None
        if resumed is None and plan.config.model.init_from:
            load_hf_weights(c.model_parts, folder=plan.config.model.init_from, model=plan.config.model)
    start_step = resumed.step if resumed is not None else 0
    if rank.is_main:
        _open_run_dir(plan, resumed=resumed is not None or restarted, start_step=start_step, console=console)
    c, parts = run_parts(plan, c, start_step=start_step, snapshots=snapshots, console=console, estimate_s=estimate.step_s)
    if resumed is not None:
        parts.restore(resumed.state)
    try:
        with parts.stop.installed(), explain_oom(plan, rank=rank, snapshots=snapshots, built=built):
            result = train_recovering(
                c,
                loop=parts.loop(plan, c),
                start_step=start_step,
                root=plan.checkpoint_root,
                saver=parts.saver,
                say=_say(console, rank),
                run_dir=plan.run_dir,
            )
            parts.saver.close()
    finally:
        parts.close()
        snapshots.close()
    if result.stopped_early and rank.is_main:
        console.print(_stopped_text(parts.stop.received, step=result.last_step, run_dir=plan.run_dir, saved=bool(parts.saver.records)))
    return _summary(result, c, saver=parts.saver, wall_s=time.perf_counter() - started, estimate=estimate)


def _summary(result: LoopResult, c: Components, *, saver: store.CheckpointSaver, wall_s: float, estimate: Estimate) -> RunSummary:
    return RunSummary(
        first_loss=result.first_loss,
        last_loss=result.last_loss,
        last_step=result.last_step,
        wall_s=wall_s,
        checkpoint=saver.records[-1].path if saver.records else None,
        stopped_early=result.stopped_early,
        step_time_s=_typical(result.step_times),
        peak_memory_bytes=measured_peak_bytes(result.measured),
        val_loss=result.val_loss,
        skipped_steps=c.guard.skipped,
        rollbacks=c.guard.rollbacks,
        estimate=estimate,
        eval_seconds=tuple(result.eval_seconds),
    )


def _say(console: Console, rank: RankInfo) -> Callable[[str], None]:
    """Print a line on rank 0 (as written), nothing elsewhere."""
    return (lambda text: console.print(text, style="yellow", highlight=False, markup=False)) if rank.is_main else (lambda text: None)


def _stopped_text(signal_name: str | None, *, step: int, run_dir: Path, saved: bool) -> Text:
    """What a stopped run prints: how to continue, or how to start again without a checkpoint."""
    head = (f"stopped by {signal_name} after step {step}", "bold yellow")
    if saved:
        return Text.assemble(head, f"; continue with:\n  llmforge resume {pasteable('ckpt', run_dir, override=False)}")
    return Text.assemble(
        head,
        f"; no checkpoint was saved, so there is nothing to resume: start again with "
        f"`llmforge pretrain ... {pasteable('run.dir', run_dir)} --overwrite`",
    )


def _typical(times: list[float]) -> float | None:
    """The median step time of the logged windows, leaving out the first (warm-up) when others exist."""
    later = times[1:] or times
    return statistics.median(later) if later else None
