"""What the training loop's progress reports cost: the tiny recipe's step time with the reports
written into a memory-mapped file (as every rank of a torchrun job does) against the same loop
with the reports switched off, in interleaved rounds so machine noise hits both alike; and the
cost of one report alone, times the reports a step makes, as a check of the difference.

    python tools/bench_progress.py [--steps 40] [--rounds 7] [--clock wall|cpu] [overrides...]

Target: under 1% of the step time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmforge.config.compose import compose
from llmforge.plan import RunPlan
from llmforge.processes import progress
from llmforge.train import loop, step
from llmforge.train.build import build_components
from llmforge.train.components import RankInfo
from llmforge.train.run import make_sampler, prepare_data


def timed_loop(plan: RunPlan, prepared, *, steps: int, clock: Callable[[], float]) -> float:
    """Seconds per step of ``steps`` steps of the run's own loop (built fresh, same seed)."""
    torch.manual_seed(plan.config.train.seed)
    c = build_components(plan, rank=RankInfo(), sampler=make_sampler(plan, prepared))
    cfg = plan.config
    started = clock()
    loop.train_loop(
        c, start_step=0, total_steps=steps, grad_clip=cfg.optim.grad_clip, log_interval=cfg.train.log_interval, checkpoint_interval=0
    )
    return (clock() - started) / steps


def reports(on: bool) -> None:
    """Switch the loop's and the step's reports on (the process's reporter) or off (a no-op)."""
    mark = progress.reporter.mark if on else (lambda *args, **kwargs: None)
    loop.mark = step.mark = mark  # type: ignore[attr-defined]


def one_report_s(calls: int = 200_000) -> float:
    started = time.perf_counter()
    for i in range(calls):
        progress.reporter.mark("forward", step=i, microbatch=1)
    return (time.perf_counter() - started) / calls


def reports_per_step(plan: RunPlan) -> int:
    """data, forward, optimizer, log in the loop; forward and backward per microbatch and comm in the step."""
    micro = plan.config.train.global_batch_size // plan.config.train.micro_batch_size
    return 4 + 2 * micro + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall clock, or this process's CPU time (shared machines)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    plan = RunPlan.build(compose(["logging=quiet", *args.overrides]))
    from rich.console import Console

    prepared = prepare_data(plan, console=Console(stderr=True))
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    with tempfile.TemporaryDirectory() as folder:
        progress.reporter.open(progress.progress_path(Path(folder), 0), attempt=0)
        per_report = one_report_s()
        timed_loop(plan, prepared, steps=3, clock=clock)  # warm-up
        on, off = [], []
        for _ in range(args.rounds):
            reports(True)
            on.append(timed_loop(plan, prepared, steps=args.steps, clock=clock))
            reports(False)
            off.append(timed_loop(plan, prepared, steps=args.steps, clock=clock))
        progress.reporter.close()
    per_step = reports_per_step(plan)
    print(f"tiny recipe: {plan.tokens_per_step} tokens/step, {args.steps} steps x {args.rounds} rounds, {args.clock} clock")
    print(f"step time: with reports {statistics.median(on) * 1e3:.2f} ms, without {statistics.median(off) * 1e3:.2f} ms (medians)")
    paired = sorted(a / b - 1 for a, b in zip(on, off, strict=True))
    print(f"per-round cost: {', '.join(f'{r:+.2%}' for r in paired)}; median {statistics.median(paired):+.2%}")
    share = per_step * per_report / statistics.median(off)
    print(f"one report {per_report * 1e6:.2f} us x {per_step} per step = {share:.3%} of the step (target < 1%)")


if __name__ == "__main__":
    main()
