"""Typed keys of a run's health watch, ``cluster.health``: when a rank that makes no progress is
hung, how often ranks compare their step times, and the accelerator check before the run.
Used by ``llmforge.config.schema.ClusterConfig``; this module imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.fields import knob


@dataclass
class HealthConfig:
    hang_factor: float = knob(
        10.0,
        range="[1, inf)",
        help="A rank whose training loop reports no progress (step, microbatch, phase) for this many estimated step times "
        "(at least cluster.health.hang_floor_s) is hung: every rank's stack (and flight recorder) is written to run.dir/hangs/ "
        "and the job ends, or restarts under cluster.max_restarts.",
    )
    hang_floor_s: float = knob(
        60.0, range="(0, inf)", help="The shortest time without progress taken as a hang, seconds (a floor under hang_factor x step time)."
    )
    hang_long_s: float = knob(
        600.0,
        range="(0, inf)",
        help="The bound, seconds, for what the estimate does not time: start-up (data, build, restore), the first step of an "
        "attempt (compile, warm-up), checkpoints and evaluation.",
    )
    straggler_interval: int = knob(
        100,
        range="[0, inf)",
        help="Every N steps (at the first logged step from each multiple of N) the ranks gather their data, compute and "
        "communication times in one small all-gather; the slowest rank and its ratio to the median and to the estimate go "
        "to the console, metrics.jsonl and W&B. 0 = never.",
    )
    straggler_ratio: float = knob(
        1.2,
        range="(1, inf)",
        help="A rank whose compute time over a report interval is above this multiple of the ranks' median is named as a "
        "straggler, with its node and device.",
    )
    device_check: bool | None = knob(
        None,
        help="Before the model is built, every rank times a matmul and a memory copy on its device and the run is refused "
        "(exit 2) when one is below cluster.health.device_min_fraction of the hardware profile; null = on for accelerators, "
        "off on CPU.",
    )
    device_min_fraction: float = knob(
        0.5,
        range="(0, 1]",
        help="The device check refuses a device whose matmul or memory-copy rate is below this fraction of what its "
        "profile expects (peak x matmul_efficiency, memory_bandwidth x bandwidth_efficiency).",
    )
    device_check_proceed: bool = knob(False, help="A device below the fraction is named and the run goes on instead of being refused.")
