"""Instruments around a rank's training loop: the profiler over train.profile, memory
snapshots, the out-of-memory report, and the fault injection that drills restarts."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Callable, Iterator, List

import torch
from rich.console import Console

from llmforge.plan import RunPlan
from llmforge.train.components import Components, RankInfo
from llmforge.train.loop import LoopHooks


def add_profiler(plan: RunPlan, hooks: LoopHooks, closers: List[Callable[[], None]], *, snapshots, rank: RankInfo, start_step: int, console: Console) -> None:
    """train.profile's trace on this rank, and the memory snapshot at its end (train.memory_snapshot=profile)."""
    from llmforge.observe.profile import StepProfiler

    t, out_dir = plan.config.train, plan.run_dir / "profile"
    if t.profile is None:
        return
    say = (lambda text: console.print(text, highlight=False)) if rank.is_main else (lambda text: None)
    profiler = StepProfiler(steps=t.profile, start_step=start_step, out_dir=out_dir, rank=rank.rank, cuda=rank.device.type == "cuda",
                            on_written=lambda path: say(f"profile trace: {path} (open at ui.perfetto.dev or in TensorBoard)"))
    closers.append(profiler.close)

    def after_step(step: int) -> None:
        profiler.step(step)
        if step == profiler.last and t.memory_snapshot == "profile":
            path = snapshots.dump(f"memory_step{step}")
            say(f"memory snapshot: {path} (open at pytorch.org/memory_viz)" if path else "train.memory_snapshot: CUDA only, nothing recorded on CPU")

    hooks.after_step = after_step


#: ``RANK:STEP``: that rank exits abruptly (exit code 1) after optimizer step STEP, on the
#: first attempt of a job only: how the restart path is exercised (tests, drills).
FAULT_ENV = "LLMFORGE_FAULT"


def inject_fault(hooks: LoopHooks, *, rank: RankInfo) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return
    fault_rank, fault_step = (int(x) for x in spec.split(":"))
    if fault_rank != rank.rank:
        return
    inner = hooks.after_step

    def after_step(step: int) -> None:
        inner(step)
        if step == fault_step:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    hooks.after_step = after_step


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
def explain_oom(plan: RunPlan, *, rank: RankInfo, snapshots, built: List[Components]) -> Iterator[None]:
    """An out-of-memory error becomes a user error naming the snapshot and the estimate to check
    (step 0: while building the model and optimizer or loading the checkpoint)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        from llmforge.observe.profile import out_of_memory_error

        step = built[0].scheduler.last_epoch + 1 if built else 0
        snapshot = snapshots.dump(f"oom_step{step}")
        plan_path = plan.run_dir / "plan.json"
        if rank.is_main and not plan_path.is_file():
            from llmforge.rundir import write_plan

            write_plan(plan)
        raise out_of_memory_error(exc, rank=rank.rank, step=step, snapshot=snapshot, plan_path=plan_path) from None
