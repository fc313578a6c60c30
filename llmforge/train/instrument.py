"""Instruments around a rank's training loop: the profiler over train.profile, memory
snapshots, the out-of-memory report, and the fault injection that drills restarts and anomalies."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from rich.console import Console

from llmforge.config.choices import MemorySnapshot
from llmforge.config.train_rules import FAULT_ENV, parse_fault  # the spec is checked before launch (llmforge.launch.checks)
from llmforge.observe.profile import StepProfiler, out_of_memory_error
from llmforge.parallel.dtensor import local
from llmforge.plan import RunPlan
from llmforge.rundir import write_plan
from llmforge.train.components import Components, RankInfo
from llmforge.train.loop import LoopHooks


def add_profiler(
    plan: RunPlan, hooks: LoopHooks, closers: list[Callable[[], None]], *, snapshots, rank: RankInfo, start_step: int, console: Console
) -> None:
    """train.profile's trace on this rank, and the memory snapshot at its end (train.memory_snapshot=profile)."""
    t, out_dir = plan.config.train, plan.run_dir / "profile"
    if t.profile is None:
        return
    say = (lambda text: console.print(text, highlight=False)) if rank.is_main else (lambda text: None)
    profiler = StepProfiler(
        steps=t.profile,
        start_step=start_step,
        out_dir=out_dir,
        rank=rank.rank,
        cuda=rank.device.type == "cuda",
        on_written=lambda path: say(f"profile trace: {path} (open at ui.perfetto.dev or in TensorBoard)"),
    )
    closers.append(profiler.close)

    def after_step(step: int) -> None:
        profiler.step(step)
        if step == profiler.last and t.memory_snapshot == MemorySnapshot.PROFILE:
            path = snapshots.dump(f"memory_step{step}")
            say(
                f"memory snapshot: {path} (open at pytorch.org/memory_viz)"
                if path
                else "train.memory_snapshot: CUDA only, nothing recorded on CPU"
            )

    hooks.after_step = after_step


def inject_fault(hooks: LoopHooks, c: Components, *, rank: RankInfo, spec: str | None = None) -> None:
    """Arm ``spec`` (default: ``$LLMFORGE_FAULT``) on this rank."""
    spec = spec if spec is not None else os.environ.get(FAULT_ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return
    fault_rank, first, last, kind = parse_fault(spec)
    if fault_rank != rank.rank:
        return
    if kind != "exit":
        c.step = PoisonedStep(inner=c.step, c=c, first=first, last=last, grads=kind == "nan-grad")
        return
    inner = hooks.after_step

    def after_step(step: int) -> None:
        inner(step)
        if step == first:
            sys.stdout.flush()
            print(
                f"{FAULT_ENV}={spec}: rank {rank.rank} exits after step {step} (exit code 1), as the drill asks",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    hooks.after_step = after_step


@dataclass
class PoisonedStep:
    """A step runner that puts a NaN into this rank's loss (or one gradient element) on steps
    ``first``..``last``: what a bad batch, an overflow or a flaky device does."""

    inner: object
    c: Components
    first: int
    last: int
    grads: bool

    def __call__(self, batch: torch.Tensor):
        out = self.inner(batch)  # type: ignore[operator]
        step = self.c.scheduler.last_epoch + 1
        if self.first <= step <= self.last:
            if self.grads:
                grad = next(p.grad for p in self.c.parameters() if p.grad is not None and local(p.grad).numel())
                with torch.no_grad():
                    local(grad).view(-1)[0] = float("nan")
            else:
                out.loss = out.loss * float("nan")
        return out

    def evaluate(self, batch: torch.Tensor) -> float:
        return self.inner.evaluate(batch)  # type: ignore[attr-defined]


#: ``STEP``: after optimizer step STEP (first attempt only) the rank SIGKILLs its launcher, whose
#: torchrun agent and ranks die with it: a node lost for good, for elastic drills (set it on one node).
NODE_LOSS_ENV = "LLMFORGE_NODE_LOSS"


def inject_node_loss(hooks: LoopHooks) -> None:
    spec = os.environ.get(NODE_LOSS_ENV)
    if not spec or "TORCHELASTIC_RESTART_COUNT" not in os.environ or int(os.environ["TORCHELASTIC_RESTART_COUNT"] or 0) > 0:
        return
    launcher = os.getppid()  # torchrun's agent runs inside the llmforge launcher, which starts the ranks
    inner = hooks.after_step

    def after_step(step: int) -> None:
        inner(step)
        if step == int(spec):
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(launcher, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    hooks.after_step = after_step


@contextlib.contextmanager
def explain_oom(plan: RunPlan, *, rank: RankInfo, snapshots, built: list[Components]) -> Iterator[None]:
    """An out-of-memory error becomes a user error naming the snapshot and the estimate to check
    (step 0: while building the model and optimizer or loading the checkpoint)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        step = built[0].scheduler.last_epoch + 1 if built else 0
        snapshot = snapshots.dump(f"oom_step{step}")
        plan_path = plan.run_dir / "plan.json"
        if rank.is_main and not plan_path.is_file():
            write_plan(plan)
        raise out_of_memory_error(exc, rank=rank.rank, step=step, snapshot=snapshot, plan_path=plan_path) from None
