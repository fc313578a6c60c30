"""The program torchrun starts on every rank: join the group, build the mesh, run.

    python -m torch.distributed.run ... -m llmforge.parallel.worker --plan RUN/plan.json [--resume CKPT]

Rank 0 alone prints and logs. When torchrun restarts the ranks after a failure
(``cluster.max_restarts``), they continue from the run's newest complete checkpoint. An error on a rank is written to
``$LLMFORGE_ERROR_DIR/rank<N>.json`` (the launcher shows the first one, once)
or, without that variable, printed; the rank then exits at once with code 2 for
a user error and 1 otherwise, and torchrun stops the other ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator, List, Optional

ERROR_DIR_ENV = "LLMFORGE_ERROR_DIR"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def attempt() -> int:
    """How many times torchrun has restarted the ranks of this job (cluster.max_restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_point(plan, *, resume: Optional[Path], console) -> Optional[Path]:
    """Where a restarted attempt continues: the run's newest complete checkpoint (chosen by
    rank 0 for every rank), else where the first attempt started. Collective."""
    import torch.distributed as dist

    if attempt() == 0:
        return resume
    found: List[Optional[str]] = [None]
    if dist.get_rank() == 0:
        from llmforge.checkpoint.locate import newest_complete
        from llmforge.errors import UserError

        try:
            found[0] = str(newest_complete(plan.run_dir / "checkpoints").path)
        except UserError:
            found[0] = None
        where = f"resuming from {found[0]}" if found[0] else (f"starting again from {resume}" if resume else "starting over (no checkpoint yet)")
        console.print(f"[bold yellow]restart {attempt()} of {plan.config.cluster.max_restarts}[/] after a failed rank: {where}", highlight=False)
    dist.broadcast_object_list(found, src=0)
    return Path(found[0]) if found[0] else resume


@contextlib.contextmanager
def report_errors() -> Iterator[None]:
    """Turn any exception on this rank into one error record and an immediate exit."""
    from llmforge.errors import UserError

    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - every failure must end the rank
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        user = isinstance(exc, UserError)
        record = {
            "rank": _rank(),
            "attempt": attempt(),
            "time": time.time(),
            "kind": "user" if user else "error",
            "message": exc.message() if user else "".join(traceback.format_exception(exc)),
        }
        folder = os.environ.get(ERROR_DIR_ENV)
        if folder:
            path = Path(folder) / f"rank{_rank()}.json"
            path.write_text(json.dumps(record))
        else:
            print(f"rank {_rank()}: {record['message']}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(2 if user else 1)


def run_rank(*, plan_path: Path, resume: Optional[Path]) -> None:
    import torch.distributed as dist
    from rich.console import Console

    from llmforge.parallel.guard import install_from_env
    from llmforge.parallel.mesh import build_mesh, init_distributed
    from llmforge.plan import RunPlan
    from llmforge.train.components import RankInfo
    from llmforge.train.run import prepare_data, run

    plan = RunPlan.load(plan_path)
    device = init_distributed(plan)
    install_from_env(device)
    main = dist.get_rank() == 0
    console = Console(stderr=True) if main else Console(file=io.StringIO(), quiet=True)
    mesh = build_mesh(plan, device_type=device.type)
    rank = RankInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), dp_rank=mesh.local_rank("dp"), dp_size=plan.dp, device=device, mesh=mesh)
    if main:
        prepare_data(plan, console=console)  # fills the shared cache before the others read it
    dist.barrier()
    resume = restart_point(plan, resume=resume, console=console)
    summary = run(plan, rank=rank, resume_from=resume, console=console, restarted=attempt() > 0)
    if main:
        console.print(summary.describe(plan))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="llmforge.parallel.worker")
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--resume", type=Path, default=None)
    args = parser.parse_args(argv)
    with report_errors():
        run_rank(plan_path=args.plan, resume=args.resume)


if __name__ == "__main__":
    main()
