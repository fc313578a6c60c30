"""Compiled code that falls out of compile is named: graph breaks after the first steps, and
recompiles after them, with dynamo's reasons (llmforge.train.compile_watch)."""

from __future__ import annotations

import torch

from llmforge.train.compile_watch import WATCH_STEPS, CompileWatch


def test_graph_breaks_and_later_recompiles_are_named():
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def broken(x):
        y = x.sin()
        print("a print breaks the graph")
        return y.cos()

    @torch.compile(backend="eager", dynamic=False)
    def steady(x):
        return x * 2

    said: list[str] = []
    watch = CompileWatch(say=said.append, check_every=1)
    for step in range(1, WATCH_STEPS + 1):
        broken(torch.ones(3))
        steady(torch.ones(3))
        watch.step_end(step)
    assert len(said) == 1 and "graph break" in said[0] and "print" in said[0]  # named after the first steps
    steady(torch.ones(5))  # a new shape: compiled again
    watch.step_end(WATCH_STEPS + 1)
    assert len(said) == 2 and "compiled again 1 time" in said[1] and "size" in said[1]
    watch.step_end(WATCH_STEPS + 2)
    assert len(said) == 2  # nothing new, nothing said


def test_what_earlier_runs_in_the_process_left_is_not_reported():
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def broken(x):
        print("a print breaks the graph")
        return x + 1

    broken(torch.ones(2))
    said: list[str] = []
    watch = CompileWatch(say=said.append, check_every=1)
    for step in range(1, WATCH_STEPS + 2):
        watch.step_end(step)
    assert said == []


def test_a_compiled_run_watches_on_rank_0_only():
    from rich.console import Console

    from llmforge.testing.harness import tiny_plan
    from llmforge.train.compile_watch import compile_watch

    console = Console(file=None, quiet=True)
    assert [type(p).__name__ for p in compile_watch(tiny_plan(["train.compile=true"]), is_main=True, console=console)] == ["CompileWatch"]
    assert compile_watch(tiny_plan(["train.compile=true"]), is_main=False, console=console) == []
    assert compile_watch(tiny_plan([]), is_main=True, console=console) == []


def test_evaluation_without_gradients_is_not_a_recompile_to_report():
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def block(x):
        return x * 2

    said: list[str] = []
    watch = CompileWatch(say=said.append, check_every=1)
    x = torch.ones(3, requires_grad=True)
    for step in range(1, WATCH_STEPS + 1):
        block(x)
        watch.step_end(step)
    with torch.no_grad():  # validation: an inference graph, compiled once
        block(x)
    watch.step_end(WATCH_STEPS + 1)
    assert said == []


def test_recompiles_are_named_after_dynamo_window_of_compiles_is_full():
    from torch._dynamo.utils import DEFAULT_COMPILATION_METRICS_LIMIT

    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 3, backend="eager", dynamic=False)
    fn(torch.ones(2))
    fn(torch.ones(3))  # a recompile before the run, in dynamo's window
    said: list[str] = []
    watch = CompileWatch(say=said.append, check_every=1)
    for step in range(1, WATCH_STEPS + 1):
        watch.step_end(step)
    for n in range(DEFAULT_COMPILATION_METRICS_LIMIT + 1):  # more compiles than the window holds
        torch.compile(eval(f"lambda x: x + {n}"), backend="eager")(torch.ones(2))  # each its own code
    fn(torch.ones(4))  # a recompile after the window filled up
    watch.step_end(WATCH_STEPS + 1)
    assert len(said) == 1 and "compiled again 1 time" in said[0]
