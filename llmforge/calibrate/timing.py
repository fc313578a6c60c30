"""Timing a callable on a device: warm up, then the fastest of a few rounds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], *, device: torch.device, budget_s: float, rounds: int = 5) -> float:
    """Seconds one call of ``fn`` takes: the fastest of ``rounds`` rounds that together
    take about ``budget_s`` (the fastest, not the mean: what the machine can do, with as
    little as possible of what else ran on it at the time)."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    once = max(time.perf_counter() - start, 1e-7)
    if once * rounds > budget_s:  # a slow call: one more is enough
        start = time.perf_counter()
        fn()
        synchronize(device)
        return min(once, time.perf_counter() - start)
    calls = max(1, math.floor(budget_s / rounds / once))
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best
