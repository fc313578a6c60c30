"""Timing a callable on a device the way benchmark harnesses do (triton's ``do_bench``,
``torch.utils.benchmark``, nccl-tests): warm up without timing, then the median of several
rounds of back-to-back calls.

- Warm-up: the first calls of a kernel pay for what later ones do not (cuDNN and flash
  attention choosing their kernels, lazy CUDA module loading, the caching allocator growing,
  a CPU's thread pool waking up, a GPU's clocks rising); timed, they would make the first of
  the calibration's passes slower than the others. At least ``WARMUP_CALLS`` calls and a quarter
  of the budget run before any timing.
- Rounds: each round times enough back-to-back calls that the clock's and the
  synchronization's cost are a small share of it, and the result is the median round, as
  ``torch.utils.benchmark`` reports: a training step runs at the machine's typical speed, not
  at its best moment. On a CPU whose memory system others share, the fastest round read the
  memory-bound rate 6.4 to 8.5 GB/s in three calibrations of one quiet machine, and the
  closing lines it gave dp2 moved from 1.03x to 1.23x. A call too slow for several in a round
  is timed alone, as many times as there are rounds: a quiet CPU's single calls of a few
  milliseconds vary by up to 2x (the page faults of fresh outputs and the scheduler).
- On a GPU each round is timed with CUDA events on the stream (device time from the first
  launch to the last kernel's end) after a synchronize, so the host's wake-up from the
  synchronize is not counted.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

#: Untimed calls before any timing (the first pays for kernel selection and allocation).
WARMUP_CALLS = 2
#: Rounds of a timing, each its own (the median is kept), however slow a call is.
ROUNDS = 5
#: The host's clock (an argument of the tests).
clock = time.perf_counter


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], *, calls: int, device: torch.device) -> float:
    """Seconds ``calls`` back-to-back calls of ``fn`` take, all their work finished."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    begin = clock()
    for _ in range(calls):
        fn()
    return clock() - begin


def warm_up(fn: Callable[[], object], *, device: torch.device, budget_s: float) -> float:
    """Call ``fn`` at least ``WARMUP_CALLS`` times and for a quarter of ``budget_s``, none of
    them a result; seconds the last of them took (what sizes the rounds)."""
    fn()
    synchronize(device)
    deadline = clock() + budget_s / 4
    once = math.inf
    for index in range(1, 1000):
        once = max(time_calls(fn, calls=1, device=device), 1e-7)
        if index >= WARMUP_CALLS - 1 and (clock() >= deadline or once > budget_s / 4):
            break
    return once


def seconds_per_call(fn: Callable[[], object], *, device: torch.device, budget_s: float, rounds: int = ROUNDS) -> float:
    """Seconds one call of ``fn`` takes: after a warm-up, the median of ``rounds`` rounds of
    back-to-back calls that together take about ``budget_s`` (a call too slow for that: one a
    round, over the budget)."""
    once = warm_up(fn, device=device, budget_s=budget_s)
    if once * rounds > budget_s:  # a slow call: alone in each round
        return statistics.median(time_calls(fn, calls=1, device=device) for _ in range(rounds))
    calls = max(1, math.floor(budget_s / rounds / once))
    return statistics.median(time_calls(fn, calls=calls, device=device) / calls for _ in range(rounds))
