"""Measured speed and memory of a run, next to what the estimator predicted.

At each logged step the loop adds, for this rank:

- ``mfu``: model FLOPs per step (6·N + 12·L·h·s per token, the estimator's
  convention) / step time / (world size x the accelerator profile's dense peak);
- peak memory since the start: ``peak_allocated_gib`` and ``peak_reserved_gib``
  (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``) on a GPU,
  ``peak_rss_gib`` (the process's peak resident memory since ``reset_peak_rss``, which
  the rank calls before its build) on a CPU.

Reading these asks the allocator or the OS, never the device: no synchronisation.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

from llmforge.estimate.core import Estimate

GIB = 1024**3


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak memory (GiB) on ``device``."""
    if device.type == "cuda":
        return {
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    return {"peak_rss_gib": peak_rss_bytes() / GIB}


def reset_peak_rss() -> None:
    """Start the peak resident memory afresh from what the process holds now (Linux), so that
    the peak is the rank's run (what it still holds included) and not what this process did
    before it: the launcher's estimate and a first CPU run's calibration in one process."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> float:
    """The process's peak resident memory: Linux's high-water mark (``VmHWM``, which
    ``reset_peak_rss`` resets), else ``getrusage``'s lifetime peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss * (1 if sys.platform == "darwin" else 1024))


def measured_peak_bytes(memory: dict[str, float]) -> float | None:
    """The figure compared with the estimate: reserved on a GPU (what the allocator
    holds), resident memory on a CPU."""
    value = memory.get("peak_reserved_gib", memory.get("peak_rss_gib"))
    return None if value is None else value * GIB


@dataclass
class StepMeter:
    """MFU and peak memory of this rank for a measured step time.

    ``model_flops_per_step``: of the whole job (every rank); ``peak_flops``: one
    device's dense peak in the run's compute dtype."""

    model_flops_per_step: float
    peak_flops: float
    world_size: int
    device: torch.device
    #: The peak is a rough guess (``peak_approximate`` in the hardware profile): MFU is shown as approximate.
    peak_approximate: bool = False

    def __call__(self, step_time_s: float) -> dict[str, float]:
        record = {"mfu": self.mfu(step_time_s)}
        record.update(peak_memory(self.device))
        return record

    def mfu(self, step_time_s: float) -> float:
        if step_time_s <= 0 or self.peak_flops <= 0:
            return 0.0
        return self.model_flops_per_step / (step_time_s * self.world_size * self.peak_flops)


def meter_for(est: Estimate, *, device: torch.device) -> StepMeter:
    """The meter of a run from its estimate: model FLOPs per step, peak from ``cluster.accelerator``."""
    job = est.job
    return StepMeter(
        model_flops_per_step=est.model_flops,
        peak_flops=job.profile.peak(job.param_dtype),
        world_size=est.layout.world,
        device=device,
        peak_approximate=job.profile.peak_approximate and not job.profile.calibrated,
    )
