"""The accelerator check (``cluster.health.device_check``): before the model is built, every rank
times a square matmul and a memory copy on its device with calibration's timer
(``llmforge.calibrate.timing``, the probes of ``llmforge.calibrate.compute``), and the run is
refused (exit 2) when a device reaches less than ``cluster.health.device_min_fraction`` of what
its hardware profile expects: ``peak x matmul_efficiency`` FLOP/s and ``memory_bandwidth x
bandwidth_efficiency`` bytes/s, the rates the estimate uses. A throttled GPU, wrong clocks or
degraded memory run the whole job at their speed; a few seconds here find them.

``device_problem`` (the verdict) needs no torch; ``check_accelerators`` measures.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from llmforge.calibrate.timing import seconds_per_call
from llmforge.config.dtypes import TORCH_NAMES
from llmforge.errors import Problem, UserError
from llmforge.hardware import get_profile
from llmforge.plan import RunPlan

#: ``RANK``: that rank's device probe is slowed (each timed call sleeps), as a drill of a slow device.
SLOW_DEVICE_ENV = "LLMFORGE_SLOW_DEVICE"


@dataclass(frozen=True)
class DeviceSpeed:
    """One rank's measured rates (FLOP/s of the matmul, bytes/s of the copy) and where it runs."""

    rank: int
    place: str
    matmul_flops: float
    copy_bytes_s: float


def wanted(plan: RunPlan) -> bool:
    """Asked for, or by default on accelerators (a CPU's rates vary with its load)."""
    h = plan.config.cluster.health
    return h.device_check if h.device_check is not None else plan.config.cluster.accelerator != "cpu"


def probe_dtype(plan: RunPlan) -> str:
    return plan.config.precision.param_dtype.value if plan.config.cluster.accelerator != "cpu" else "fp32"


def expected_rates(plan: RunPlan) -> tuple[float, float]:
    """(FLOP/s, bytes/s) the profile expects of one device: what the estimate assumes."""
    p = get_profile(plan.config.cluster.accelerator)
    return p.peak(probe_dtype(plan)) * p.matmul_efficiency, p.memory_bandwidth * p.bandwidth_efficiency


def device_problem(plan: RunPlan, speeds: list[DeviceSpeed]) -> Problem | None:
    """The refusal naming every device below the fraction, or None."""
    h, flops, bandwidth = plan.config.cluster.health, *expected_rates(plan)
    slow = [s for s in speeds if s.matmul_flops < h.device_min_fraction * flops or s.copy_bytes_s < h.device_min_fraction * bandwidth]
    if not slow:
        return None
    named = "; ".join(
        f"rank {s.rank} ({s.place}): matmul {s.matmul_flops / 1e12:.3g} TFLOP/s ({s.matmul_flops / flops:.2f}x), "
        f"copy {s.copy_bytes_s / 1e9:.3g} GB/s ({s.copy_bytes_s / bandwidth:.2f}x)"
        for s in slow
    )
    return Problem(
        "cluster.health.device_check",
        h.device_check,
        f"{len(slow)} device(s) below {h.device_min_fraction:g} x what profile {plan.config.cluster.accelerator} expects "
        f"({flops / 1e12:.3g} TFLOP/s {probe_dtype(plan)} matmul, {bandwidth / 1e9:.3g} GB/s copy): {named}. "
        "Look for throttling, wrong clocks or a degraded device (nvidia-smi -q -d PERFORMANCE,CLOCK,ECC)",
        "replace or drain those nodes and run again; or go on at their speed with cluster.health.device_check_proceed=true, "
        "or lower cluster.health.device_min_fraction",
    )


def measure(*, device, dtype: str, rank: int) -> DeviceSpeed:
    """This rank's matmul and copy rates (a second or two on a GPU)."""
    import torch

    n, elements, budget = (4096, 2**26, 0.3) if device.type == "cuda" else (256, 2**20, 0.05)
    slowed = os.environ.get(SLOW_DEVICE_ENV, "") == str(rank)
    a = torch.randn(n, n, device=device, dtype=getattr(torch, TORCH_NAMES[dtype]))
    src, dst = torch.randn(elements, device=device), torch.empty(elements, device=device)

    def timed(fn):
        return (lambda: (time.sleep(0.05), fn())) if slowed else fn

    matmul_s = seconds_per_call(timed(lambda: a @ a), device=device, budget_s=budget)
    copy_s = seconds_per_call(timed(lambda: dst.copy_(src)), device=device, budget_s=budget)
    place = f"node {socket.gethostname()}, device {device}"
    return DeviceSpeed(rank=rank, place=place, matmul_flops=2 * n**3 / matmul_s, copy_bytes_s=8 * elements / copy_s)


def check_accelerators(plan: RunPlan, *, device, console) -> None:
    """Measure every rank, judge all of them (every rank stops on a refusal); rank 0 prints the figures."""
    if not wanted(plan):
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = measure(device=device, dtype=probe_dtype(plan), rank=rank)
    speeds = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        speeds = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(speeds, mine)
    problem = device_problem(plan, speeds)
    if problem is not None and not plan.config.cluster.health.device_check_proceed:
        raise UserError([problem], title="a device is too slow for this profile")
    if problem is not None:
        console.print(f"device check: {problem.rule}; going on (cluster.health.device_check_proceed=true)", style="yellow", markup=False)
        return
    slowest = min(speeds, key=lambda s: s.matmul_flops)
    console.print(
        f"device check: {len(speeds)} device(s), slowest matmul {slowest.matmul_flops / 1e12:.3g} TFLOP/s, "
        f"copy {min(s.copy_bytes_s for s in speeds) / 1e9:.3g} GB/s",
        highlight=False,
    )
