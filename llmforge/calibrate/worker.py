"""What torchrun starts on every rank of ``llmforge calibrate`` over several ranks:

    python -m torch.distributed.run ... -m llmforge.calibrate.worker --accelerator cpu --out SAMPLES.json [--quick]

Rank 0 measures its device's compute while the others wait; then every rank runs the
collectives inside its node and, across nodes, over the whole world, and CPU ranks run
small tensor-parallel training steps inside their node (``llmforge.calibrate.tp_step``); rank 0 writes
the timings as JSON for the launcher to fit. Errors are reported as a training rank's
are (``llmforge.processes.rank_errors.report_errors``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path

from llmforge.calibrate import collectives, compute, tp_step
from llmforge.calibrate.fit import samples_to_dict
from llmforge.calibrate.run import progress_bar
from llmforge.files import write_text_atomic
from llmforge.hardware import cpu_threads
from llmforge.parallel.mesh import init_distributed
from llmforge.processes.rank_errors import end_rank, report_errors
from llmforge.processes.watch import guard_rank


def run_rank(*, accelerator: str, out: Path, quick: bool, timeout_s: float) -> None:
    import torch.distributed as dist
    from rich.console import Console

    device = init_distributed(accelerator=accelerator, timeout_s=timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    main = rank == 0
    console = Console(stderr=True, markup=False) if main else Console(file=io.StringIO(), quiet=True)
    threads = cpu_threads(per_node) if device.type == "cpu" else 1
    comm_groups = collectives.groups(nodes=world // per_node, per_node=per_node)
    sizes = collectives.sizes(device, quick=quick)
    with progress_bar(console, label="calibrating", enabled=main) as start:
        samples = None
        if main:
            samples = compute.measure(device, quick=quick, threads=threads, tick=start(compute.steps(device, quick=quick)))
        dist.barrier()
        tick = start(len(comm_groups) * len(collectives.OPS) * len(sizes))
        comm = []
        for link, group in comm_groups:
            comm += collectives.sweep(link=link, group=group, device=device, byte_sizes=sizes, tick=tick)
            if device.type == "cpu" and link == "intra" and tp_step.can_shard(ranks=dist.get_world_size(group)):
                comm += tp_step.tp_step_samples(link=link, group=group, quick=quick)
    if main:
        write_text_atomic(out, json.dumps(samples_to_dict(samples, comm)))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmforge.calibrate.worker")
    parser.add_argument("--accelerator", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    guard_rank(int(os.environ.get("RANK", "0")))
    with report_errors():
        run_rank(accelerator=args.accelerator, out=args.out, quick=args.quick, timeout_s=args.timeout)
    end_rank()


if __name__ == "__main__":
    main()
