"""A CPU rank's step by kind of kernel, profiled, against the estimate's terms for it.

One process runs the step a rank of ``parallel=single`` (two threads, all the microbatches) or of
``parallel=dp2`` (one thread, half the microbatches, without the gradient all-reduce) runs, with
``llmforge.calibrate.tp_step.stepper``; torch.profiler sums the operators' own time over steady
steps into the estimate's kinds: matmuls (``mm``, ``addmm``, ``bmm``), the fused attention, and the
rest (memory-bound kernels, the launch floor, the optimizer and the host work between them). The
profiler's own cost lands in the measured kinds (8-14% of the tiny recipe's step, most of it on
the many small ops of "rest"); the last line times the whole step without it.
Run it on a quiet machine after ``llmforge calibrate`` (and ``cluster.devices_per_node=2``):

    python tools/cpu_step_terms.py [--layout single|dp2] [--steps 3] [overrides...]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
WARMUP_STEPS = 15


def _unprofiled(step, *, steps: int) -> float:
    """Seconds a step takes without the profiler (its median over ``steps``)."""
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _profiled(step, *, steps: int) -> dict[str, float]:
    """Seconds a step of each kind (the operators' own time, averaged over ``steps``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    kinds: collections.Counter = collections.Counter()
    for event in prof.key_averages():
        name = event.key
        kind = "matmul" if name in MATMULS else "attention" if "scaled_dot_product" in name else "rest"
        kinds[kind] += event.self_cpu_time_total / steps / 1e6
    return dict(kinds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=("single", "dp2"), default="dp2")
    parser.add_argument("--steps", type=int, default=3)
    args, overrides = parser.parse_known_args()

    from llmforge.calibrate.tp_step import stepper
    from llmforge.config.compose import compose
    from llmforge.estimate.core import estimate_plan
    from llmforge.plan import RunPlan

    ranks = 2 if args.layout == "dp2" else 1
    extra = ["cluster.devices_per_node=2"] if ranks > 1 else []
    config = compose(["recipe=tiny", "logging=quiet", f"parallel={args.layout}", *extra, *overrides])
    torch.set_num_threads(1 if ranks > 1 else 2)
    micro = config.train.micro_batch_size
    microbatches = config.train.global_batch_size // micro // ranks
    step = stepper(config.model, micro_batch=micro, microbatches=microbatches, group=None)
    for _ in range(WARMUP_STEPS):
        step()
    wall = _unprofiled(step, steps=max(5, args.steps))
    measured = _profiled(step, steps=args.steps)
    terms = estimate_plan(RunPlan.build(config)).terms
    estimated = {
        "matmul": terms["matmul"],
        "attention": terms["attention"],
        "rest": terms["memory_bound"] + terms["launch_floor"] + terms["optimizer"],
    }
    print(f"{args.layout} rank, {torch.get_num_threads()} thread(s), {microbatches} microbatches of {micro}")
    print(f"{'kind':10s} {'measured':>9s} {'estimate':>9s} {'ratio':>7s}  (seconds a step; rest: memory-bound, floor, optimizer, host)")
    for kind in ("matmul", "attention", "rest"):
        m, e = measured.get(kind, 0.0), estimated[kind]
        print(f"{kind:10s} {m:9.4f} {e:9.4f} {m / e if e else float('nan'):6.2f}x")
    total_m, total_e = sum(measured.values()), sum(estimated.values())
    print(f"{'total':10s} {total_m:9.4f} {total_e:9.4f} {total_m / total_e:6.2f}x")
    print(f"{'unprofiled':10s} {wall:9.4f} {total_e:9.4f} {wall / total_e:6.2f}x  (the whole step, timed without the profiler)")


if __name__ == "__main__":
    main()
