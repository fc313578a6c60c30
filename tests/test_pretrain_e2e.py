"""End to end: `llmforge pretrain` trains, logs, checkpoints and writes a W&B offline run."""

from __future__ import annotations

import json
import math
import re

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.observe.metrics import read_metrics

runner = CliRunner()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, small_data):
    run_dir = tmp_path_factory.mktemp("run")
    args = [
        "pretrain",
        *small_data,
        f"run.dir={run_dir}",
        "train.steps=8",
        "train.log_interval=1",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "checkpoint.interval=4",
        "logging.wandb.mode=offline",
        "logging.console=false",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return run_dir, result.output


def test_metrics_jsonl_has_every_step_and_the_loss_falls(finished_run):
    run_dir, _ = finished_run
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    for record in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "peak_rss_gib"} <= record.keys()
        assert math.isfinite(record["loss"]) and record["tokens_per_s"] > 0
        # MFU follows from the logged step time: model FLOPs per step / time / the cpu profile's fp32 peak (0.1 TFLOP/s)
        assert record["mfu"] == pytest.approx(_model_flops(run_dir) / record["step_time_s"] / 0.1e12, rel=1e-9)
        assert 0.05 < record["peak_rss_gib"] < 64
    assert records[0]["loss"] == pytest.approx(math.log(4096), rel=0.05)  # untrained: uniform over the vocabulary
    assert records[-1]["loss"] < records[0]["loss"]
    assert 0 < records[0]["lr"] < records[-1]["lr"]  # inside the warm-up


def test_checkpoints_at_the_interval_and_the_end(finished_run):
    run_dir, _ = finished_run
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_4", "step_8"]
    assert not any(p.name.startswith(".tmp") for p in (run_dir / "checkpoints").iterdir())


def test_plan_json_is_written(finished_run):
    run_dir, _ = finished_run
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["config"]["train"]["steps"] == 8 and plan["derived"]["world_size"] == 1


def test_wandb_offline_run_holds_config_and_metrics(finished_run):
    run_dir, _ = finished_run
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    files = {p.name for p in runs[0].rglob("*")}
    assert any(name.endswith(".wandb") for name in files)
    history = b"".join(p.read_bytes() for p in runs[0].rglob("*.wandb"))
    assert b"grad_norm" in history and b"micro_batch_size" in history


def _model_flops(run_dir) -> float:
    from llmforge.estimate import flops
    from llmforge.estimate.shape import from_plan
    from llmforge.plan import RunPlan

    plan = RunPlan.load(run_dir / "plan.json")
    return flops.model_flops(from_plan(plan)[0], plan.tokens_per_step)


def test_summary_line_is_printed_with_measured_against_estimated(finished_run):
    _, output = finished_run
    text = output.replace("\n", " ")
    assert "done" in text and "step 8" in text
    assert re.search(r"measured/estimate:\s+step\s+time\s+[0-9.]+x .*peak\s+memory\s+[0-9.]+x", text)


def test_the_estimate_is_shown_before_launch(finished_run):
    _, output = finished_run
    assert "fits" in output.lower()


def test_a_second_pretrain_into_the_same_run_dir_is_refused(finished_run, small_data):
    run_dir, _ = finished_run
    before = (run_dir / "metrics.jsonl").read_text()
    result = runner.invoke(app, ["pretrain", *small_data, f"run.dir={run_dir}", "train.steps=2", "logging=quiet"])
    assert result.exit_code == 2
    assert "already holds a run" in result.output and "llmforge resume" in result.output and "--overwrite" in result.output
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_overwrite_starts_over(tmp_path, small_data):
    run_dir = tmp_path / "run"
    args = ["pretrain", *small_data, f"run.dir={run_dir}", "train.steps=2", "train.log_interval=1", "logging=quiet"]
    assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, [*args, "train.steps=1", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]


def test_missing_data_file_is_a_user_error(tmp_path):
    result = runner.invoke(
        app,
        ["pretrain", "data=files", f"data.path={tmp_path / 'nope.txt'}", f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'c'}"],
    )
    assert result.exit_code == 2
    assert "nope.txt" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()
