"""``cluster.launcher=skypilot``: a SkyPilot task, launched with ``sky launch`` (or, for a
job that recovers from failures, ``sky jobs launch``).

Rendezvous: SkyPilot runs the task's ``run`` script on every node with
``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS`` (one per line, the first node's first),
``SKYPILOT_NUM_NODES`` and ``SKYPILOT_NUM_GPUS_PER_NODE`` set; the first node's address
is the master's. An elastic plan (``cluster.min_nodes``) meets at a c10d rendezvous
there with torchrun's node range, and its job is a managed one, which SkyPilot relaunches
when a node is lost.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from rich.console import Console

from llmforge.elastic import is_elastic
from llmforge.errors import Problem, UserError
from llmforge.launch.platform import PLAN_ENV, job_name, mounts, node_script, plan_text, to_yaml
from llmforge.launch.torchrun import procs_per_node, rendezvous_conf
from llmforge.plan import RunPlan

#: SkyPilot's accelerator names of the built-in hardware profiles.
ACCELERATORS = {
    "h100-80gb": "H100",
    "h100-96gb-hbm2e": "GH200",
    "h200-141gb": "H200",
    "b200": "B200",
    "a100-80gb": "A100-80GB",
    "a100-40gb": "A100",
    "l4-24gb": "L4",
}
SUBMIT_HINT = "without it the task is launched with `sky launch` (a managed job: `sky jobs launch`)"
MASTER = 'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)'


def managed(plan: RunPlan) -> bool:
    """A managed job (relaunched after failures and preemptions): asked for, or needed by restarts, an elastic range or spot."""
    c = plan.config.cluster
    if c.skypilot.managed is not None:
        return c.skypilot.managed
    return c.max_restarts > 0 or is_elastic(plan.config) or c.skypilot.use_spot


def accelerators(plan: RunPlan) -> str:
    """``NAME:COUNT`` for resources.accelerators (a UserError for a profile SkyPilot has no name for)."""
    c = plan.config.cluster
    name = c.skypilot.accelerators or ACCELERATORS.get(c.accelerator)
    if name is None:
        raise UserError(
            [
                Problem(
                    "cluster.skypilot.accelerators",
                    None,
                    f"SkyPilot needs the accelerator's name, and cluster.accelerator={c.accelerator} has none built in",
                    "set cluster.skypilot.accelerators=H100 (SkyPilot's name: sky show-gpus lists them)",
                )
            ],
            title="the plan cannot be written for skypilot",
        )
    return f"{name}:{procs_per_node(plan)}"


def torchrun_options(plan: RunPlan) -> list[str]:
    c = plan.config.cluster
    port = c.skypilot.port
    per_node = str(procs_per_node(plan)) if c.accelerator == "cpu" else '"$SKYPILOT_NUM_GPUS_PER_NODE"'
    if is_elastic(plan.config):
        return [
            f"--nnodes={c.min_nodes}:{c.nodes}",
            f"--nproc-per-node={per_node}",
            "--rdzv-backend=c10d",
            f'--rdzv-endpoint="$MASTER_ADDR:{port}"',
            '--rdzv-id="$SKYPILOT_TASK_ID"',
            rendezvous_conf(c.elastic_wait_s),
            f"--max-restarts={c.max_restarts}",
            "--monitor-interval=0.2",
        ]
    return [
        '--nnodes="$SKYPILOT_NUM_NODES"',
        f"--nproc-per-node={per_node}",
        '--node-rank="$SKYPILOT_NODE_RANK"',
        '--master-addr="$MASTER_ADDR"',
        f"--master-port={port}",
        "--monitor-interval=0.2",
    ]


def manifest(plan: RunPlan) -> dict:
    """The SkyPilot task (YAML's fields, in SkyPilot's order)."""
    c = plan.config.cluster
    s = c.skypilot
    resources: dict = {}
    if s.infra:
        resources["infra"] = s.infra
    if c.accelerator != "cpu":
        resources["accelerators"] = accelerators(plan)
    if c.image:
        resources["image_id"] = f"docker:{c.image}"
    resources["use_spot"] = s.use_spot
    if managed(plan):
        resources["job_recovery"] = {"max_restarts_on_errors": c.max_restarts}
    task = {"name": job_name(plan), "num_nodes": c.nodes, "resources": resources, "envs": {PLAN_ENV: plan_text(plan)}}
    modes = {"data": "MOUNT", "runs": "MOUNT_CACHED"}
    task["file_mounts"] = {path: {"source": source, "mode": modes[kind]} for kind, (source, path) in mounts(plan).items()}
    if s.setup:
        task["setup"] = s.setup
    task["run"] = node_script(plan, torchrun=torchrun_options(plan), prelude=[MASTER])
    return task


def submit(plan: RunPlan, task: dict, *, console: Console) -> None:
    """``sky launch`` (or ``sky jobs launch``) the task from a temporary YAML file; SkyPilot
    streams its own progress and says itself when no cloud is enabled (``sky check``)."""
    sky = shutil.which("sky")
    if sky is None:
        raise UserError(
            [
                Problem(
                    "cluster.launcher",
                    "skypilot",
                    "launching needs SkyPilot's `sky` command, which is not installed",
                    "pip install 'skypilot[aws]' (or [gcp], [kubernetes], ...: your infra) and run `sky check`; "
                    "or print the task with --dry-run",
                )
            ],
            title="cannot launch the task",
        )
    with tempfile.TemporaryDirectory(prefix="llmforge-sky-") as folder:
        path = Path(folder) / "task.yaml"
        path.write_text(to_yaml(task))
        command = (
            [sky, "jobs", "launch", "-y", "-n", task["name"], str(path)]
            if managed(plan)
            else [sky, "launch", "-y", "-c", task["name"], str(path)]
        )
        console.print("running: " + " ".join(command[:-1]) + " TASK.yaml", markup=False, highlight=False)
        code = subprocess.call(command, stdin=subprocess.DEVNULL)
    if code:
        raise UserError(
            [
                Problem(
                    "cluster.launcher",
                    "skypilot",
                    f"`{' '.join(command[1:3])}` failed (exit code {code}); its output above says why",
                    "run `sky check` to see which infra is enabled, or print the task with --dry-run",
                )
            ],
            title="cannot launch the task",
        )
