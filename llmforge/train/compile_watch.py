"""Compiled blocks that fall out of compile are named, never silent (``train.compile``).

A graph break splits a compiled block: the ops around it run eagerly, and inside a block under
op-level selective recompute dynamo then runs the whole block eagerly under a Python dispatch
mode (the slowest way to train it). A recompile after the first steps means a guard keeps failing
(a shape, a dtype or a Python value that changes between steps), and each costs a compile.

dynamo counts both: ``torch._dynamo.utils.counters["graph_break"]`` holds each break's reason
(the op or construct it could not trace) and ``get_compilation_metrics()`` each compile's
``recompile_reason`` in a window of its latest 64 compiles (the watch keeps its place in it
by the entry it last saw). Evaluation without gradients compiles inference graphs once: those
recompiles are expected and not reported. ``CompileWatch`` reads them on rank 0 after the first ``WATCH_STEPS`` steps
(the first forward, backward and accumulation compile there) and again at every logged step,
and prints what is new, loudly, with the reasons.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from rich.console import Console

from llmforge.plan import RunPlan
from llmforge.train.callbacks import Callback

WATCH_STEPS = 2
#: The reasons a message names (the rest are counted).
SHOWN = 3


def graph_breaks() -> collections.Counter[str]:
    """Every graph break dynamo has counted in this process, by reason."""
    from torch._dynamo.utils import counters

    return collections.Counter({str(reason): int(n) for reason, n in counters["graph_break"].items()})


#: Guards that fail when evaluation runs the compiled blocks without gradients: the inference
#: graphs it compiles once are expected, not a sign of trouble.
EVALUATION_GUARDS = ("grad_mode", "requires_grad mismatch")


def compilations() -> list[object]:
    """dynamo's record of its latest compiles in this process (a bounded window), oldest first."""
    from torch._dynamo.utils import get_compilation_metrics

    return list(get_compilation_metrics())


def recompile_reasons(metrics: list[object]) -> list[str]:
    """The reasons of the recompiles among ``metrics``, but those evaluation without gradients causes."""
    reasons = [str(getattr(m, "recompile_reason", None) or "") for m in metrics]
    return [r for r in reasons if r and not any(guard in r for guard in EVALUATION_GUARDS)]


def after(metrics: list[object], last: object | None) -> list[object]:
    """The entries of ``metrics`` after ``last`` (all of them when ``last`` left dynamo's window)."""
    marks = [i for i, m in enumerate(metrics) if m is last]
    return metrics[marks[-1] + 1 :] if marks else metrics


class CompileWatch(Callback):
    """Says, after the first steps and at each logged step, which graph breaks and recompiles are new."""

    def __init__(self, *, say: Callable[[str], None], check_every: int) -> None:
        self.say = say
        self.check_every = max(1, check_every)
        self.breaks = graph_breaks()  # what earlier compiles in this process left: not this run's
        self.last = _last(compilations())
        self.steps = 0

    def step_end(self, step: int) -> None:
        self.steps += 1
        warmup = self.steps == WATCH_STEPS
        if self.steps < WATCH_STEPS or (not warmup and step % self.check_every):
            return
        for message in self.news(step, warmup=warmup):
            self.say(message)

    def news(self, step: int, *, warmup: bool = False) -> list[str]:
        """Messages on the graph breaks and recompiles since the last check (``warmup``: the first
        check, after the steps that compile: their compiles are not recompiles to report)."""
        out = []
        breaks = graph_breaks()
        new = breaks - self.breaks
        self.breaks = breaks
        if new:
            out.append(
                f"WARNING train.compile: {new.total()} graph break(s) in compiled code by step {step}; the ops around each "
                "run eagerly (a block under selective recompute runs eagerly as a whole; TORCH_LOGS=graph_breaks shows where): "
                f"{_reasons(new)}"
            )
        metrics = compilations()
        fresh = recompile_reasons(after(metrics, self.last))
        self.last = _last(metrics) or self.last
        if fresh and not warmup:
            out.append(
                f"WARNING train.compile: compiled again {len(fresh)} time(s) after the first {WATCH_STEPS} steps (a guard failed): "
                f"{_reasons(collections.Counter(fresh))} (TORCH_LOGS=recompiles shows each)"
            )
        return out


def _last(metrics: list[object]) -> object | None:
    return metrics[-1] if metrics else None


def _reasons(counts: collections.Counter[str]) -> str:
    shown = "; ".join(f"{' '.join(reason.split())} (x{n})" for reason, n in counts.most_common(SHOWN))
    rest = len(counts) - SHOWN
    return shown + (f"; and {rest} more" if rest > 0 else "")


def compile_watch(plan: RunPlan, *, is_main: bool, console: Console) -> list[Callback]:
    """The watch on rank 0 of a run with ``train.compile``."""
    if not plan.config.train.compile or not is_main:
        return []
    say = lambda text: console.print(text, style="bold yellow", markup=False, highlight=False)  # noqa: E731
    return [CompileWatch(say=say, check_every=plan.config.train.log_interval)]
