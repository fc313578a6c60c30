"""``llmforge calibrate``: measure this machine (``llmforge.calibrate``), show the measured
figures next to the datasheet profile they started from, and write the profile."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmforge.errors import UserError

#: Calibrations tried before a busy machine's figures are written, flagged.
ATTEMPTS = 3


def calibrate_command(
    overrides: Sequence[str], *, config_dir: Sequence[Path], quick: bool, out: Path | None, name: str | None, command: str, console: Console
) -> Path:
    """Calibrate the ``cluster.*`` of the composed config and write its profile; the path.
    One calibration at a time on a machine (``llmforge.calibrate.lock``), from measuring to writing."""
    from llmforge.calibrate.lock import calibration_lock
    from llmforge.calibrate.run import Request, check_request, untrusted_note
    from llmforge.calibrate.write import check_name, check_out, profile_text, write_profile
    from llmforge.config.compose import compose
    from llmforge.hardware import cpu_threads, is_known, unknown_problem
    from llmforge.storage import local_output

    if out is not None:
        local_output(out, key="--out", example="profiles/mine.yaml")
    c = compose(list(overrides), extra_dirs=list(config_dir)).cluster
    if not is_known(c.accelerator):
        raise UserError([unknown_problem(c.accelerator)], title="cannot calibrate")
    check_name(name)
    req = Request(
        accelerator=c.accelerator,
        nodes=c.nodes,
        per_node=c.devices_per_node or 1,
        rdzv_endpoint=c.rdzv_endpoint,
        timeout_s=c.timeout_s,
        quick=quick,
        command=command,
    )
    threads = cpu_threads(req.per_node) if req.on_cpu else None
    path = out or default_path(req, name=name, threads=threads)
    check_out(path, given=out is not None)
    check_request(req)
    started = time.perf_counter()
    with calibration_lock(say=lambda text: console.print(text, style="yellow", markup=False, highlight=False)):
        result = calibrate(req, threads=threads, name=name, console=console)
        write_profile(path, profile_text(result.data, description=describe(result)))
    render(result, console=console)
    if not result.verdict.trusted:
        console.print(
            f"{untrusted_note(result.verdict)} (the profile says so: calibration.trusted: false)",
            style="yellow",
            markup=False,
            highlight=False,
        )
    console.print(
        f"calibrated in {time.perf_counter() - started:.0f}s; wrote "
        f"{path}\n{how_to_use(req, path=path, name=result.data['name'], out=out)}",
        markup=False,
        highlight=False,
    )
    return path


def default_path(req, *, name: str | None, threads: int | None) -> Path:
    """This machine's cpu profile on a CPU, else ``LLMFORGE_HOME/profiles/NAME.yaml``."""
    from llmforge.hardware import home_profiles, machine_profile_path

    if req.on_cpu and name is None:
        return machine_profile_path(threads or 1)
    return home_profiles() / f"{name or Path(req.accelerator).stem}.yaml"


def calibrate(req, *, threads: int | None, name: str | None, console: Console):
    """Measure, then fit into a profile (``Result.data``)."""
    from llmforge.calibrate.run import Result, measure_here, measure_ranks, measure_trusted, profile_data, progress_bar
    from llmforge.calibrate.write import datasheet_profile, provenance

    datasheet = datasheet_profile(req.accelerator)

    def measure():
        if req.world > 1:
            return measure_ranks(req, threads=threads, console=console)
        with progress_bar(console, label="calibrating") as start:
            return measure_here(req, threads=threads, tick_total=start), []

    say = lambda text: console.print(text, style="yellow", markup=False, highlight=False)  # noqa: E731
    compute, comm, verdict = measure_trusted(measure, attempts=ATTEMPTS, say=say)
    result = Result(datasheet=datasheet, compute=compute, comm=comm, verdict=verdict)
    prov = provenance(
        device=compute.device_name, threads=threads, ranks=req.world, quick=req.quick, started_from=datasheet, command=req.command
    )
    result.data = profile_data(result, name=name or datasheet.name, provenance=prov)
    return result


def describe(result) -> str:
    return f"{result.compute.device_name}, measured by llmforge calibrate (from the {result.datasheet.name} profile)"


def how_to_use(req, *, path: Path, name: str, out: Path | None) -> str:
    if req.on_cpu and out is None and name == "cpu":
        return "cluster.accelerator=cpu uses it on this machine (estimate, pretrain, the progress bar's MFU)"
    if out is None:
        return f"select it with cluster.accelerator={name}"
    import shlex

    return f"select it with {shlex.quote(f'cluster.accelerator={path}')}"


#: The host costs of parallelism a CPU calibration measures (``llmforge.calibrate.host_probe``).
HOST_COSTS = ("dtensor_op_us", "fsdp_unit_us", "fsdp_collective_us", "fsdp_param_us")


def comparison_rows(result) -> list[tuple]:
    """(figure, datasheet, measured) rows of the table."""
    from llmforge.calibrate.write import ALWAYS_SET
    from llmforge.hardware import parse_profile

    before, after = result.datasheet, parse_profile(result.data, source="calibrated")
    rows = [
        (f"peak {d} TFLOP/s", f"{before.peak_flops.get(d, 0) / 1e12:.4g}", f"{after.peak_flops[d] / 1e12:.4g}") for d in after.peak_flops
    ]
    rows += [
        (
            f"{d} matmul TFLOP/s, large (peak x efficiency)",
            f"{before.peak_flops.get(d, 0) * before.matmul_efficiency / 1e12:.4g}",
            f"{after.peak_flops[d] * after.matmul_efficiency / 1e12:.4g}",
        )
        for d in after.peak_flops
    ]
    for key in ALWAYS_SET:
        rows.append((key, f"{getattr(before, key):.3g}", f"{getattr(after, key):.3g}"))
    for key in HOST_COSTS:  # measured on CPUs only
        if getattr(after, key):
            rows.append((key, f"{getattr(before, key):.3g}", f"{getattr(after, key):.3g}"))
    rows.append(
        (
            "memory-bound GB/s (bandwidth x efficiency)",
            f"{before.memory_bandwidth * before.bandwidth_efficiency / 1e9:.4g}",
            f"{after.memory_bandwidth * after.bandwidth_efficiency / 1e9:.4g}",
        )
    )
    rows.append(("device memory GiB", f"{before.memory_bytes / 2**30:.4g}", f"{after.memory_bytes / 2**30:.4g}"))
    if result.comm:
        for link, attr in (("intra", "intra_node_bandwidth"), ("inter", "inter_node_bandwidth")):
            rows.append(
                (
                    f"{link}-node bus GB/s achieved",
                    f"{getattr(before, attr) * before.comm_efficiency / 1e9:.4g}",
                    f"{getattr(after, attr) * after.comm_efficiency / 1e9:.4g}",
                )
            )
        rows.append(("collective latency us", f"{before.comm_latency_us:.3g}", f"{after.comm_latency_us:.3g}"))
        rows.append(("blocking collective wait us", f"{before.comm_sync_us:.3g}", f"{after.comm_sync_us:.3g}"))
    return rows


def render(result, *, console: Console) -> None:
    table = Table(title=f"{result.compute.device_name}: measured vs the {result.datasheet.name} profile")
    for column in ("figure", result.datasheet.name, "measured"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for row in comparison_rows(result):
        table.add_row(*row)
    console.print(table)
    if result.comm:
        console.print(comm_table(result.comm))


def comm_table(samples) -> Table:
    """The collectives, as nccl-tests prints them."""
    from llmforge.calibrate.fit import TP_STEP

    table = Table(title="collectives (busbw = algbw x 2(n-1)/n all_reduce, (n-1)/n gather/scatter/all-to-all, 1 send/recv)")
    for column in ("op", "link", "ranks", "size", "time us", "algbw GB/s", "busbw GB/s"):
        table.add_column(column, justify="left" if column in ("op", "link") else "right")
    for s in samples:
        if s.op == TP_STEP:  # the comparison's "tensor-parallel collective wait"
            continue
        size = f"{s.nbytes / 2**20:.0f} MiB"
        table.add_row(s.op, s.link, str(s.ranks), size, f"{s.seconds * 1e6:.1f}", f"{s.algbw / 1e9:.3g}", f"{s.busbw / 1e9:.3g}")
    return table
