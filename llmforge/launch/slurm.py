"""An sbatch script that runs the plan's torchrun command on every node under srun."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rich.console import Console

from llmforge.elastic import is_elastic
from llmforge.files import write_text_atomic
from llmforge.launch.torchrun import procs_per_node, restart_env, torchrun_args, worker_args
from llmforge.plan import RunPlan

#: The rendezvous port on the first node when cluster.rdzv_endpoint is not set.
DEFAULT_PORT = 29500


def slurm_script(plan: RunPlan, *, plan_path: Path, resume_from: Path | None) -> str:
    """An sbatch script running the same torchrun command on every node under srun."""
    c = plan.config.cluster
    endpoint = c.rdzv_endpoint or f"$head_node:{DEFAULT_PORT}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(plan, endpoint="RDZV_ENDPOINT", run_id="RDZV_ID")]
    command = " ".join(shlex.quote(a) for a in torchrun + worker_args(plan_path=plan_path, resume_from=resume_from))
    # Substituted after quoting so that the shell expands them on each node.
    command = command.replace("RDZV_ENDPOINT", endpoint).replace("RDZV_ID", "$SLURM_JOB_ID")
    gpus = [] if c.accelerator == "cpu" else [f"#SBATCH --gpus-per-node={procs_per_node(plan)}"]
    elastic = is_elastic(plan.config)
    # elastic: any node count of the range, and a lost node ends neither the allocation nor the step
    nodes = [f"#SBATCH --nodes={c.min_nodes}-{c.nodes}", "#SBATCH --no-kill"] if elastic else [f"#SBATCH --nodes={c.nodes}"]
    srun = "srun --no-kill --kill-on-bad-exit=0" if elastic else "srun --kill-on-bad-exit=1"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={plan.config.run.name}",
        *nodes,
        "#SBATCH --ntasks-per-node=1",
        *gpus,
        f"#SBATCH --output={plan.run_dir.resolve()}/slurm-%j.out",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        *[f"export {k}={v}" for k, v in restart_env(plan).items()],
        f"{srun} {command}",
    ]
    return "\n".join(lines) + "\n"


def submit_script(plan: RunPlan, *, plan_path: Path, resume_from: Path | None, dry_run: bool, console: Console) -> None:
    """Write ``run.dir/launch.sbatch`` (next to the plan it runs), or with ``dry_run`` print it."""
    script = slurm_script(plan, plan_path=plan_path, resume_from=resume_from)
    if dry_run:
        console.print(script, highlight=False, markup=False, soft_wrap=True)
        console.print(
            f"(--dry-run writes nothing; without it this script is written to {plan.run_dir / 'launch.sbatch'} with the plan it runs, "
            f"{plan_path})",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        return
    path = plan.run_dir / "launch.sbatch"
    write_text_atomic(path, script)
    console.print(f"wrote {path}; submit it with: sbatch {path}", highlight=False, markup=False)
