"""One calibration: measure (in this process, or on every rank through torchrun), fit,
and the profile it makes."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from llmforge.calibrate import compute, fit, tp_wait, trust
from llmforge.calibrate.fit import CommSample, ComputeSamples
from llmforge.calibrate.trust import Verdict
from llmforge.calibrate.write import as_mapping
from llmforge.errors import Problem, UserError
from llmforge.hardware import Profile, parse_profile
from llmforge.processes.torchrun import cluster_args, run_torchrun

WORKER = "llmforge.calibrate.worker"


@dataclass(frozen=True)
class Request:
    """What to calibrate: the ``cluster.*`` keys pretrain launches with, and the output."""

    accelerator: str
    nodes: int = 1
    per_node: int = 1
    rdzv_endpoint: str | None = None
    timeout_s: int = 300
    quick: bool = False
    command: str = "llmforge calibrate"

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def on_cpu(self) -> bool:
        return self.accelerator == "cpu"


@dataclass
class Result:
    datasheet: Profile
    compute: ComputeSamples
    comm: list[CommSample] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # the calibrated profile's YAML keys
    verdict: Verdict = field(default_factory=Verdict)


def check_request(req: Request) -> None:
    """What must hold before anything is measured (every problem at once, exit code 2)."""
    problems = []
    if not req.on_cpu:
        import torch

        if not torch.cuda.is_available():
            problems.append(
                Problem(
                    "cluster.accelerator",
                    req.accelerator,
                    "calibrating a GPU profile needs a CUDA device, and this machine has none",
                    "run llmforge calibrate on the GPU machine, or calibrate this CPU with cluster.accelerator=cpu",
                )
            )
    if req.nodes > 1 and not req.rdzv_endpoint:
        problems.append(
            Problem(
                "cluster.rdzv_endpoint",
                None,
                "a calibration across nodes needs a rendezvous address every node can reach",
                "set cluster.rdzv_endpoint=HOST:PORT (the first node)",
            )
        )
    if problems:
        raise UserError(problems, title="cannot calibrate")


def measure_here(req: Request, *, threads: int | None, tick_total: Callable[[int], Callable[[str], None]]) -> ComputeSamples:
    """Compute figures of this process's device (one rank: no collectives)."""
    import torch

    device = torch.device("cpu") if req.on_cpu else torch.device("cuda", 0)
    tick = tick_total(compute.steps(device, quick=req.quick))
    return compute.measure(device, quick=req.quick, threads=threads or 1, tick=tick)


def untrusted_note(verdict: Verdict) -> str:
    """What a flagged calibration says (after its retries)."""
    return (
        f"these figures were measured on a busy machine ({'; '.join(verdict.reasons)}) and may be too low: "
        "run llmforge calibrate again when the machine is quiet"
    )


def measure_ranks(req: Request, *, threads: int | None, console: Console) -> tuple[ComputeSamples, list[CommSample]]:
    """Compute (rank 0) and collectives (every rank) through torchrun, the way pretrain launches."""
    with tempfile.TemporaryDirectory(prefix="llmforge-calibrate-") as folder:
        out = Path(folder) / "samples.json"
        argv = cluster_args(nodes=req.nodes, per_node=req.per_node, endpoint=req.rdzv_endpoint, max_restarts=0, run_id="llmforge-calibrate")
        argv += ["-m", WORKER, "--accelerator", req.accelerator, "--out", str(out), "--timeout", str(req.timeout_s)]
        argv += ["--quick"] if req.quick else []
        run_torchrun(argv, console=console, threads=threads or 1, hang_s=None)
        if not out.is_file():  # another node's rank 0 holds the results
            raise UserError("this node's ranks finished; the profile is written on the node of rank 0", title="calibration done elsewhere")
        return fit.samples_from_dict(json.loads(out.read_text()))


Measure = Callable[[], tuple[ComputeSamples, list[CommSample]]]
#: Seconds between a busy machine's attempts (a burst of other work may pass).
PAUSE_S = 3.0


def measure_trusted(measure: Measure, *, attempts: int, say: Callable[[str], None]) -> tuple[ComputeSamples, list[CommSample], Verdict]:
    """Measure until ``trust.judge`` trusts the figures, at most ``attempts`` times (saying why
    each retry); where none is trusted, the fastest attempt (the least disturbed) and its verdict."""
    best = None
    for attempt in range(1, attempts + 1):
        compute, comm = measure()
        verdict = trust.judge(compute)
        if verdict.trusted:
            return compute, comm, verdict
        if best is None or _reference_rate(compute) > _reference_rate(best[0]):
            best = (compute, comm, verdict)
        if attempt < attempts:
            say(
                f"the machine looks busy ({'; '.join(verdict.reasons)}): measuring again in {PAUSE_S:.0f}s (try {attempt + 1} of "
                f"{attempts})"
            )
            time.sleep(PAUSE_S)
    return best


def _reference_rate(samples: ComputeSamples) -> float:
    fitted = fit.fit_compute(samples)
    return fitted.rates[fitted.reference_dtype]


def profile_data(result: Result, *, name: str, provenance: dict) -> dict:
    """The calibrated profile's keys: the datasheet's, with the fitted ones on top, and in its
    provenance whether the figures can be trusted."""
    data = fit.compute_keys(fit.fit_compute(result.compute), as_mapping(result.datasheet))
    data["name"] = name
    if result.comm:
        data = fit.comm_keys(fit.fit_comm(result.comm), data)
        data = tp_wait.wait_keys(result.comm, data, profile=parse_profile(data, source=name))
    data["calibration"] = {**provenance, **result.verdict.provenance()}
    return data


@contextlib.contextmanager
def progress_bar(console: Console, *, label: str, enabled: bool = True) -> Iterator[Callable[[int], Callable[[str], None]]]:
    """``with progress_bar(...) as start: tick = start(total); tick("what ran")``."""
    if not enabled:
        yield lambda total: lambda what: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[what]}"),
    )
    with Progress(*columns, console=console, transient=True) as progress:

        def start(total: int) -> Callable[[str], None]:
            task = progress.add_task(label, total=total, what="")
            return lambda what: progress.update(task, advance=1, what=what)

        yield start


def command_line(overrides: list[str], *, quick: bool, out: Path | None, name: str | None) -> str:
    """How this calibration was started, for the provenance."""
    import shlex

    args = [*overrides] + (["--quick"] if quick else []) + (["--out", str(out)] if out else []) + (["--name", name] if name else [])
    return shlex.join(["llmforge", "calibrate", *args])
