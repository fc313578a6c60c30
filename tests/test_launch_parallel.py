"""Launching distributed runs: torchrun command, SLURM script, failing ranks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from llmforge.errors import UserError
from llmforge.launch.run import launch_distributed
from llmforge.processes.torchrun import run_torchrun
from llmforge.testing.harness import tiny_plan


def capture() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=400), buffer


def test_slurm_dry_run_prints_the_script_and_writes_nothing(tmp_path: Path):
    plan = tiny_plan(
        [
            "cluster.launcher=slurm",
            "cluster.nodes=2",
            "cluster.devices_per_node=4",
            "cluster.accelerator=h100-80gb",
            "parallel.tp=4",
            f"run.dir={tmp_path / 'run'}",
        ]
    )
    console, out = capture()
    launch_distributed(plan, resume_from=Path("/ckpt/step_5"), dry_run=True, console=console)
    script = out.getvalue()
    assert script.startswith("#!/bin/bash")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=4" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    for part in (
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$head_node:29500",
        "--rdzv-id=$SLURM_JOB_ID",
        "llmforge.launch.worker",
        str(tmp_path / "run" / "plan.json"),
        "--resume /ckpt/step_5",
    ):
        assert part in srun
    assert not (tmp_path / "run").exists()


def test_local_dry_run_prints_the_torchrun_command(tmp_path: Path):
    plan = tiny_plan(["parallel.dp=2", "parallel.tp=2", f"run.dir={tmp_path}"])
    console, out = capture()
    launch_distributed(plan, resume_from=None, dry_run=True, console=console)
    text = out.getvalue()
    assert "--nproc-per-node=4" in text and "--standalone" in text and "llmforge.launch.worker" in text
    assert not (tmp_path / "plan.json").exists()


def test_unsupported_layouts_are_refused_before_starting(tmp_path: Path):
    with pytest.raises(UserError) as info:
        tiny_plan(["parallel.cp=2", "parallel.pp=2", "cluster.nodes=2", "cluster.devices_per_node=2", f"run.dir={tmp_path}"])
    assert "parallel.cp" in info.value.message()
    plan = tiny_plan(["parallel.cp=2", "cluster.nodes=2", "cluster.devices_per_node=1", f"run.dir={tmp_path}"])
    with pytest.raises(UserError) as info:
        launch_distributed(plan, resume_from=None, dry_run=False, console=capture()[0])
    assert "cluster.rdzv_endpoint" in info.value.message()
    assert not (tmp_path / "plan.json").exists()


def _failing_job(tmp_path: Path, kind: str) -> list[str]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"layouts": {"dp2": ["parallel.dp=2"]}, "fail_rank": 1, "fail_kind": kind}))
    return [
        "--standalone",
        "--nproc-per-node=2",
        "--monitor-interval=0.2",
        "-m",
        "llmforge.testing.harness",
        str(spec),
        str(tmp_path / "out.pt"),
    ]


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


ONE_RANK = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.vocab_size=512",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.steps=4",
    "train.log_interval=1",
    "optim.warmup_steps=0",
    "parallel.zero=3",
    "logging.console=false",
    "logging.wandb.mode=disabled",
]


def test_launcher_torchrun_dry_run_starts_one_rank_through_torchrun(tmp_path: Path):
    from llmforge.launch import launch

    console, out = capture()
    # a vocabulary a trained tokenizer can have: pretrain checks it before launching
    launch(
        tiny_plan(["cluster.launcher=torchrun", "model.vocab_size=512", f"run.dir={tmp_path}"]),
        resume_from=None,
        force=False,
        dry_run=True,
        console=console,
    )
    text = out.getvalue()
    assert "--nproc-per-node=1" in text and "llmforge.launch.worker" in text and "in this process" not in text


def test_launcher_torchrun_trains_one_rank_through_the_worker_as_in_process(tmp_path: Path, small_data, monkeypatch):
    """One rank through torchrun, the worker, a process group and a mesh of size one
    (ZeRO-3: FSDP2 over one rank) gives the losses of the same plan in this process."""
    from typer.testing import CliRunner

    from llmforge.cli import app
    from llmforge.config.compose import compose
    from llmforge.observe.metrics import read_metrics
    from llmforge.plan import RunPlan
    from llmforge.train.components import RankInfo
    from llmforge.train.run import run

    seen = tmp_path / "collectives"
    seen.mkdir()
    monkeypatch.setenv("LLMFORGE_CHECK_COLLECTIVES", str(seen))
    result = CliRunner().invoke(app, ["pretrain", *ONE_RANK, *small_data, "cluster.launcher=torchrun", f"run.dir={tmp_path / 'torchrun'}"])
    assert result.exit_code == 0, result.output
    run(RunPlan.build(compose([*ONE_RANK, *small_data, f"run.dir={tmp_path / 'here'}"])), rank=RankInfo())
    got, ref = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("torchrun", "here"))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5)
    records = [json.loads(p.read_text()) for p in seen.glob("collectives-rank0-*.json")]
    assert len(records) == 1 and records[0]["device"] == "cpu"
    assert records[0]["seen"].get("all_reduce:cpu", 0) >= 4  # at least the stop flag of every step
