"""Instruments around a rank's training loop: the profiler over train.profile (a run part),
the out-of-memory report, and the fault injection that drills restarts and anomalies (a
poisoned step, or run parts that end the rank or its node)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from rich.console import Console

from llmforge.config.choices import MemorySnapshot
from llmforge.config.train_rules import FAULT_ENV, SLOW_FAULT_S, parse_faults  # the spec is checked before launch (llmforge.launch.checks)
from llmforge.observe.profile import MemorySnapshots, StepProfiler, out_of_memory_error
from llmforge.parallel.dtensor import local
from llmforge.plan import RunPlan
from llmforge.rundir import write_plan
from llmforge.train.callbacks import Callback
from llmforge.train.components import Components, RankInfo


class Profiler(Callback):
    """train.profile's trace on this rank, and the memory snapshot at its end (train.memory_snapshot=profile)."""

    def __init__(self, plan: RunPlan, *, snapshots: MemorySnapshots, rank: RankInfo, start_step: int, console: Console) -> None:
        t = plan.config.train
        self.snapshot_at_end = t.memory_snapshot == MemorySnapshot.PROFILE
        self.snapshots = snapshots
        self.say = (lambda text: console.print(text, highlight=False)) if rank.is_main else (lambda text: None)
        self.profiler = StepProfiler(
            steps=t.profile,
            start_step=start_step,
            out_dir=plan.run_dir / "profile",
            rank=rank.rank,
            cuda=rank.device.type == "cuda",
            on_written=lambda path: self.say(f"profile trace: {path} (open at ui.perfetto.dev or in TensorBoard)"),
        )

    def step_end(self, step: int) -> None:
        self.profiler.step(step)
        if step == self.profiler.last and self.snapshot_at_end:
            path = self.snapshots.dump(f"memory_step{step}")
            self.say(
                f"memory snapshot: {path} (open at pytorch.org/memory_viz)"
                if path
                else "train.memory_snapshot: CUDA only, nothing recorded on CPU"
            )

    def close(self) -> None:
        self.profiler.close()


def profiler(plan: RunPlan, *, snapshots: MemorySnapshots, rank: RankInfo, start_step: int, console: Console) -> list[Callback]:
    """The profiler part, when train.profile asks for one."""
    if plan.config.train.profile is None:
        return []
    return [Profiler(plan, snapshots=snapshots, rank=rank, start_step=start_step, console=console)]


def inject_fault(c: Components, *, spec: str | None = None) -> tuple[Components, list[Callback]]:
    """Arm ``spec`` (default: ``$LLMFORGE_FAULT``) on this rank: the components with a poisoned
    step (``nan``, ``nan-grad``), a slowed or stuck one (``slow``, ``hang``), or the part that
    exits after a step (``exit``)."""
    spec = spec if spec is not None else os.environ.get(FAULT_ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return c, []
    parts: list[Callback] = []
    for fault_rank, first, last, kind in parse_faults(spec):
        if fault_rank != c.rank.rank:
            continue
        if kind in ("nan-loss", "nan-grad"):
            c = replace(c, step=PoisonedStep(inner=c.step, c=c, first=first, last=last, grads=kind == "nan-grad"))
        elif kind in ("hang", "slow"):
            c = replace(c, step=StalledStep(inner=c.step, c=c, first=first, last=last, hang=kind == "hang"))
        else:
            parts.append(FaultExit(spec=spec, rank=c.rank.rank, step=first))
    return c, parts


@dataclass
class StalledStep:
    """A step runner that, on steps ``first``..``last``, sleeps ``SLOW_FAULT_S`` before its forward
    (a straggler), or with ``hang`` blocks at ``first`` in a receive from the next rank, which
    never sends (a rank stuck in a collective; the others then wait in the step's reductions)."""

    inner: object
    c: Components
    first: int
    last: int
    hang: bool

    def __call__(self, batch: torch.Tensor):
        step = self.c.scheduler.last_epoch + 1
        if self.hang and step == self.first and torch.distributed.is_initialized():
            peer = (torch.distributed.get_rank() + 1) % torch.distributed.get_world_size()
            torch.distributed.recv(torch.zeros(1, device=self.c.rank.device), src=peer, tag=7)
        elif not self.hang and self.first <= step <= self.last:
            time.sleep(SLOW_FAULT_S)
        return self.inner(batch)  # type: ignore[operator]

    def evaluate(self, batch: torch.Tensor) -> float:
        return self.inner.evaluate(batch)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FaultExit(Callback):
    """Exit (code 1) after optimizer step ``step``, as the drill asks: a rank that dies."""

    spec: str
    rank: int
    step: int

    def step_end(self, step: int) -> None:
        if step == self.step:
            sys.stdout.flush()
            print(
                f"{FAULT_ENV}={self.spec}: rank {self.rank} exits after step {step} (exit code 1), as the drill asks",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


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


def node_loss() -> list[Callback]:
    """The node-loss drill of ``$LLMFORGE_NODE_LOSS`` (first attempt of a torchrun job only)."""
    spec = os.environ.get(NODE_LOSS_ENV)
    if not spec or "TORCHELASTIC_RESTART_COUNT" not in os.environ or int(os.environ["TORCHELASTIC_RESTART_COUNT"] or 0) > 0:
        return []
    return [NodeLoss(step=int(spec), launcher=os.getppid())]  # torchrun's agent runs inside the llmforge launcher


@dataclass(frozen=True)
class NodeLoss(Callback):
    """After step ``step``, SIGKILL the launcher (its agent and ranks die with it), then this rank."""

    step: int
    launcher: int

    def step_end(self, step: int) -> None:
        if step == self.step:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(self.launcher, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


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
