"""The first CPU run on a machine measures it: a quick calibration, cached per machine.

``cluster.accelerator=cpu`` otherwise means the built-in profile, whose peak and
bandwidths are guesses; a run (and its estimate, progress bar MFU and closing line)
on this machine's measured figures needs only a few seconds of measuring once.
``LLMFORGE_AUTO_CALIBRATE=0`` turns it off.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rich.console import Console

from llmforge.hardware import BUILTIN_DIR, cpu_threads, get_profile, machine_profile_path

ENV = "LLMFORGE_AUTO_CALIBRATE"


def needs_calibration(plan) -> bool:
    """A CPU plan that would run on the built-in guess (no measured or user profile)."""
    from llmforge.estimate.shape import ranks_per_node

    if plan.config.cluster.accelerator != "cpu" or os.environ.get(ENV, "1") == "0":
        return False
    return Path(get_profile("cpu", ranks_per_node=ranks_per_node(plan)).source).parent == BUILTIN_DIR


def ensure_cpu_profile(plan, *, console: Console) -> None:
    """Calibrate this CPU quickly (compute only) and cache it, if the plan needs it; one line."""
    if not needs_calibration(plan):
        return
    from llmforge.calibrate.run import Request, Result, measure_here, profile_data
    from llmforge.calibrate.write import datasheet_profile, profile_text, provenance, write_profile
    from llmforge.estimate.shape import ranks_per_node

    threads = cpu_threads(ranks_per_node(plan))
    req = Request(accelerator="cpu", quick=True, command="llmforge calibrate --quick (first CPU run on this machine)")
    started = time.perf_counter()
    compute = measure_here(req, threads=threads, tick_total=lambda total: (lambda what: None))
    result = Result(datasheet=datasheet_profile("cpu"), compute=compute)
    prov = provenance(device=compute.device_name, threads=threads, ranks=1, quick=True, started_from=result.datasheet, command=req.command)
    result.data = profile_data(result, name="cpu", provenance=prov)
    path = machine_profile_path(threads)
    try:
        write_profile(path, profile_text(result.data, description=f"{compute.device_name}, measured by llmforge's first CPU run here"))
    except OSError as exc:
        console.print(f"measured this CPU but could not cache it in {path} ({exc}); set LLMFORGE_HOME to a writable folder", style="yellow", markup=False, highlight=False)
        return
    peak = result.data["peak_tflops"]["fp32"] * 1000
    console.print(f"first run on this CPU: measured it in {time.perf_counter() - started:.0f}s ({compute.device_name}, fp32 matmuls {peak:.0f} GFLOP/s) "
                  f"and cached the profile in {path} for later runs (llmforge calibrate measures it fully)", markup=False, highlight=False)
