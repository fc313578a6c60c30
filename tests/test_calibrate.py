"""`llmforge calibrate`: a measured profile that estimate reads, over one rank and two
(gloo), the first CPU run's cached calibration, and the errors a user can cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.hardware import cpu_threads, get_profile, machine_profile_path

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def _estimate(*overrides: str) -> dict:
    result = runner.invoke(app, ["estimate", *overrides, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("calibrated") / "this-cpu.yaml"
    result = runner.invoke(app, ["calibrate", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_quick_cpu_calibration_writes_a_profile_with_its_provenance(quick_profile):
    out, output = quick_profile
    profile = get_profile(str(out))
    assert profile.calibrated and profile.name == "cpu"
    for key in ("device", "torch", "date", "command", "threads"):
        assert key in profile.calibration
    assert profile.calibration["threads"] == cpu_threads(1)
    assert "calibrate --quick --out" in profile.calibration["command"]
    assert profile.matmul_efficiency == 1.0 and all(v > 0 for v in profile.peak_flops.values())
    assert "measured" in output and "peak fp32 TFLOP/s" in output and str(out) in output.replace("\n", "")


def test_estimate_reads_the_calibrated_profile(quick_profile):
    out, _ = quick_profile
    profile = get_profile(str(out))
    builtin = _estimate()
    measured = _estimate(f"cluster.accelerator={out}")
    assert measured["time"]["step_s"] != builtin["time"]["step_s"]
    mfu = measured["flops"]["model_per_step"] / measured["time"]["step_s"] / profile.peak("fp32")
    assert measured["time"]["mfu"] == pytest.approx(mfu)


def test_two_gloo_ranks_measure_collectives_into_the_profile(tmp_path):
    out = tmp_path / "two.yaml"
    result = runner.invoke(app, ["calibrate", "--quick", "cluster.devices_per_node=2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(out.read_text())
    assert data["calibration"]["ranks"] == 2 and data["calibration"]["threads"] == cpu_threads(2)
    profile = get_profile(str(out))
    assert profile.comm_latency_us >= 0 and 0 < profile.comm_efficiency <= 1
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        assert op in result.output
    assert "busbw" in result.output
    dp2 = _estimate("parallel=dp2", f"cluster.accelerator={out}")
    assert dp2["communication_bytes"]["dp"] > 0 and dp2["time"]["step_s"] > 0


@pytest.mark.parametrize("make", ["txt", "dir", "under_file"])
def test_a_bad_out_path_is_refused_before_measuring(tmp_path, make):
    if make == "txt":
        out = tmp_path / "profile.txt"
    elif make == "dir":
        out = tmp_path / "folder.yaml"
        out.mkdir()
    else:
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "p.yaml"
    result = runner.invoke(app, ["calibrate", "--quick", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "--out" in result.output and "Traceback" not in result.output
    assert not out.is_file()


def test_a_gpu_profile_without_a_gpu_and_an_unknown_one_are_refused(tmp_path):
    unknown = runner.invoke(app, ["calibrate", "--quick", "cluster.accelerator=h1000"])
    assert unknown.exit_code == 2 and "no such hardware profile" in unknown.output
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    gpu = runner.invoke(app, ["calibrate", "--quick", "cluster.accelerator=h100-80gb", "--out", str(tmp_path / "h.yaml")])
    assert gpu.exit_code == 2 and "CUDA device" in gpu.output
    assert not (tmp_path / "h.yaml").exists()


def test_a_named_profile_in_llmforge_home_shadows_the_builtin(quick_profile, tmp_path, monkeypatch):
    out, _ = quick_profile
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path))
    data = yaml.safe_load(out.read_text())
    data["name"] = "h100-80gb"
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "h100-80gb.yaml").write_text(yaml.safe_dump(data))
    from llmforge.hardware import forget_profiles

    forget_profiles()
    try:
        assert get_profile("h100-80gb").calibrated
    finally:
        monkeypatch.delenv("LLMFORGE_HOME")
        forget_profiles()
    assert not get_profile("h100-80gb").calibrated


def test_the_first_cpu_run_calibrates_once_and_estimate_reads_the_cache_without_torch(tmp_path, small_data, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("LLMFORGE_HOME", str(home))
    monkeypatch.setenv("LLMFORGE_AUTO_CALIBRATE", "1")
    args = ["pretrain", *small_data, "train.steps=2", "train.global_batch_size=4", "logging.wandb.mode=disabled", "logging.console=false"]
    first = runner.invoke(app, [*args, f"run.dir={tmp_path / 'a'}"])
    assert first.exit_code == 0, first.output
    assert "first run on this CPU" in first.output
    cached = machine_profile_path(cpu_threads(1))
    assert cached.is_file() and get_profile("cpu").calibrated
    second = runner.invoke(app, [*args, f"run.dir={tmp_path / 'b'}"])
    assert second.exit_code == 0 and "first run on this CPU" not in second.output
    code = (
        "import sys, json; from llmforge.commands.plans import build_plan; from llmforge.estimate.core import estimate_plan\n"
        "e = estimate_plan(build_plan([]))\n"
        "print(json.dumps({'calibrated': e.job.profile.calibrated, 'torch': 'torch' in sys.modules}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert json.loads(proc.stdout) == {"calibrated": True, "torch": False}, proc.stderr[-2000:]
