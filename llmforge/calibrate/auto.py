"""The first CPU run on a machine measures it: a quick calibration, cached per machine.

``cluster.accelerator=cpu`` otherwise means the built-in profile, whose peak and
bandwidths are guesses; a run (and its estimate, progress bar MFU and closing line)
on this machine's measured figures needs only a few seconds of measuring once.
``LLMFORGE_AUTO_CALIBRATE=0`` turns it off.

Only figures that can be trusted are cached (``llmforge.calibrate.trust``): a measurement
taken on a busy machine, or one that ``LLMFORGE_HOME`` cannot hold, serves this run alone
(``hardware.UNCACHED_ENV``), and the next run measures again. A cached profile that
``llmforge calibrate`` flagged as measured on a busy machine is measured again too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console

from llmforge.calibrate import apart
from llmforge.calibrate.lock import calibration_lock
from llmforge.calibrate.run import Request, Result, measure_trusted, profile_data
from llmforge.calibrate.write import check_out, datasheet_profile, profile_text, provenance, write_profile
from llmforge.errors import UserError
from llmforge.estimate.shape import ranks_per_node
from llmforge.hardware import BUILTIN_DIR, UNCACHED_ENV, cpu_threads, get_profile, llmforge_home, machine_profile_path

ENV = "LLMFORGE_AUTO_CALIBRATE"
#: Quick calibrations a run tries before it settles for a busy machine's figures.
ATTEMPTS = 2


def needs_calibration(plan) -> bool:
    """A CPU plan that would run on the built-in guess, or on this machine's cached profile
    flagged as measured on a busy machine (no user profile of its own)."""
    if plan.config.cluster.accelerator != "cpu" or os.environ.get(ENV, "1") == "0":
        return False
    profile = get_profile("cpu", ranks_per_node=ranks_per_node(plan))
    if Path(profile.source).parent == BUILTIN_DIR:
        return True
    cached = Path(profile.source) == machine_profile_path(cpu_threads(ranks_per_node(plan)))
    return cached and profile.calibration.get("trusted") is False


def ensure_cpu_profile(plan, *, console: Console) -> None:
    """Calibrate this CPU quickly (compute only) and cache it, if the plan needs it; one line.
    One calibration at a time: a run that waited for another's re-checks what it cached."""
    if not needs_calibration(plan):
        return

    def say(text: str) -> None:
        console.print(text, style="yellow", markup=False, highlight=False)

    with calibration_lock(say=say):
        if not needs_calibration(plan):
            return
        started = time.perf_counter()
        result = _measure(plan, say=say)
        _keep(result, console=console, say=say, seconds=time.perf_counter() - started)


def _measure(plan, *, say):
    threads = cpu_threads(ranks_per_node(plan))
    req = Request(accelerator="cpu", quick=True, command="llmforge calibrate --quick (first CPU run on this machine)")
    compute, _, verdict = measure_trusted(lambda: (apart.measure_apart(quick=True, threads=threads), []), attempts=ATTEMPTS, say=say)
    result = Result(datasheet=datasheet_profile("cpu"), compute=compute, verdict=verdict)
    prov = provenance(device=compute.device_name, threads=threads, ranks=1, quick=True, started_from=result.datasheet, command=req.command)
    result.data = profile_data(result, name="cpu", provenance=prov)
    return result


def _keep(result, *, console: Console, say, seconds: float) -> None:
    """Cache trusted figures; figures that cannot be cached or trusted serve this run alone."""
    name = result.compute.device_name
    text = profile_text(result.data, description=f"{name}, measured by llmforge's first CPU run here")
    figures = f"{name}, fp32 matmuls {result.data['peak_tflops']['fp32'] * 1000:.0f} GFLOP/s"
    path = machine_profile_path(result.compute.threads)
    if not result.verdict.trusted:
        use_for_this_run(text)
        say(
            f"measured this CPU in {seconds:.0f}s ({figures}) on a busy machine ({'; '.join(result.verdict.reasons)}): this run uses "
            "these figures, but they are not cached and the next run measures again (llmforge calibrate, when the machine is quiet, "
            "caches them)" + _home_problem(path)
        )
        return
    try:
        write_profile(path, text)
    except OSError as exc:
        use_for_this_run(text)
        say(
            f"measured this CPU in {seconds:.0f}s ({figures}) and this run uses it, but LLMFORGE_HOME={llmforge_home()} cannot hold it "
            f"({exc.strerror or exc}): set LLMFORGE_HOME to a writable folder, or every run measures again"
        )
        return
    console.print(
        f"first run on this CPU: measured it in {seconds:.0f}s ({figures}) "
        f"and cached the profile in {path} for later runs (llmforge calibrate measures it fully)",
        markup=False,
        highlight=False,
    )


def _home_problem(path: Path) -> str:
    """'' where LLMFORGE_HOME could hold ``path``, else a clause that names it."""
    try:
        check_out(path, given=False)
    except UserError as exc:
        return f"; LLMFORGE_HOME={llmforge_home()} could not hold them anyway ({exc.problems[0].rule}): set it to a writable folder"
    return ""


def use_for_this_run(text: str) -> Path:
    """Make ``cpu`` mean this profile for this process and the ranks it starts (a temporary file)."""
    folder = Path(tempfile.mkdtemp(prefix="llmforge-profile-"))
    path = folder / "cpu.yaml"
    path.write_text(text, encoding="utf-8")
    os.environ[UNCACHED_ENV] = str(path)
    atexit.register(shutil.rmtree, folder, True)
    return path
