"""Launching distributed runs: torchrun command, SLURM script, failing ranks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from llmforge.errors import UserError
from llmforge.parallel.harness import tiny_plan
from llmforge.parallel.launcher import launch_distributed, run_torchrun


def capture() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=400), buffer


def test_slurm_dry_run_prints_the_script_and_writes_nothing(tmp_path: Path):
    plan = tiny_plan(["cluster.launcher=slurm", "cluster.nodes=2", "cluster.devices_per_node=4", "cluster.accelerator=h100-80gb", "parallel.tp=4", f"run.dir={tmp_path / 'run'}"])
    console, out = capture()
    launch_distributed(plan, resume_from=Path("/ckpt/step_5"), dry_run=True, console=console)
    script = out.getvalue()
    assert script.startswith("#!/bin/bash")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=4" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    for part in ("torch.distributed.run", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=$head_node:29500", "--rdzv-id=$SLURM_JOB_ID", "llmforge.parallel.worker", str(tmp_path / "run" / "plan.json"), "--resume /ckpt/step_5"):
        assert part in srun
    assert not (tmp_path / "run").exists()


def test_local_dry_run_prints_the_torchrun_command(tmp_path: Path):
    plan = tiny_plan(["parallel.dp=2", "parallel.tp=2", f"run.dir={tmp_path}"])
    console, out = capture()
    launch_distributed(plan, resume_from=None, dry_run=True, console=console)
    text = out.getvalue()
    assert "--nproc-per-node=4" in text and "--standalone" in text and "llmforge.parallel.worker" in text
    assert not (tmp_path / "plan.json").exists()


def test_unsupported_layouts_are_refused_before_starting(tmp_path: Path):
    plan = tiny_plan(["parallel.cp=2", "parallel.pp=2", "cluster.nodes=2", "cluster.devices_per_node=2", f"run.dir={tmp_path}"])
    with pytest.raises(UserError) as info:
        launch_distributed(plan, resume_from=None, dry_run=False, console=capture()[0])
    message = info.value.message()
    assert "parallel.cp" in message and "cluster.rdzv_endpoint" in message
    assert not (tmp_path / "plan.json").exists()


def _failing_job(tmp_path: Path, kind: str) -> list[str]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"layouts": {"dp2": ["parallel.dp=2"]}, "fail_rank": 1, "fail_kind": kind}))
    return ["--standalone", "--nproc-per-node=2", "--monitor-interval=0.2", "-m", "llmforge.parallel.harness", str(spec), str(tmp_path / "out.pt")]


def test_a_user_error_on_one_rank_ends_the_job_as_one_message(tmp_path: Path):
    console, out = capture()
    with pytest.raises(UserError) as info:
        run_torchrun(_failing_job(tmp_path, "user"), console=console)
    assert info.value.exit_code == 2
    assert info.value.message().count("missing.txt") == 1
    assert "Traceback" not in info.value.message() and out.getvalue() == ""


def test_a_crashing_rank_ends_the_job_and_its_error_is_shown_once(tmp_path: Path):
    console, out = capture()
    with pytest.raises(SystemExit) as info:
        run_torchrun(_failing_job(tmp_path, "error"), console=console)
    assert info.value.code == 1
    text = out.getvalue()
    assert "rank 1 failed" in text
    assert text.count("RuntimeError: injected failure on this rank") == 1
    assert not (tmp_path / "out.pt").exists()
