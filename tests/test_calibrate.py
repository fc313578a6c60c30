"""`llmforge calibrate`: the measured figures reach the profile and the estimate (on a fake
machine of known speeds, ``calibrate_fake``), the keys it does not measure are kept, a real
calibration over one rank and two (gloo), and the errors a user can cause.

The real calibrations here are judged as on a quiet machine (the tests' machine is shared):
``tests/test_calibrate_trust.py`` tests the judging itself on injected figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from calibrate_fake import GIB, FakeMachine
from typer.testing import CliRunner

from llmforge.calibrate import compute, fit, trust
from llmforge.calibrate.fit import FSDP_COSTS
from llmforge.calibrate.trust import Verdict
from llmforge.cli import app
from llmforge.commands.plans import build_plan
from llmforge.estimate.core import estimate_plan
from llmforge.hardware import cpu_threads, forget_profiles, get_profile, machine_profile_path

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def _estimate(*overrides: str):
    return estimate_plan(build_plan(list(overrides)))


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(trust, "judge", lambda samples, **_: Verdict())


@pytest.fixture
def fake(monkeypatch) -> FakeMachine:
    return FakeMachine().install(monkeypatch)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("calibrated") / "this-cpu.yaml"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trust, "judge", lambda samples, **_: Verdict())
        result = runner.invoke(app, ["calibrate", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_quick_cpu_calibration_writes_a_profile_with_its_provenance(quick_profile):
    out, output = quick_profile
    profile = get_profile(str(out))
    assert profile.calibrated and profile.name == "cpu"
    for key in ("device", "torch", "date", "command", "threads", "trusted", "repeat_spread"):
        assert key in profile.calibration
    assert profile.calibration["threads"] == cpu_threads(1) and profile.calibration["trusted"] is True
    assert "calibrate --quick --out" in profile.calibration["command"]
    assert profile.host_memory_bytes == pytest.approx(compute.host_memory_bytes(), rel=1e-3)  # the machine's, not 2 x 64 devices'
    assert "measured" in output and "peak fp32 TFLOP/s" in output and str(out) in output.replace("\n", "")


def test_the_measured_rates_reach_the_profile(fake, tmp_path):
    out = tmp_path / "fake.yaml"
    result = runner.invoke(app, ["calibrate", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    p = get_profile(str(out))
    for dtype, rate in fake.rates.items():
        assert p.peak(dtype) == pytest.approx(rate, rel=5e-3), dtype
    assert p.matmul_dim == fake.matmul_dim and p.matmul_efficiency == 1.0
    assert p.attention_efficiency == pytest.approx(fake.attention / fake.rates["fp32"], rel=5e-3)
    grid = compute.grid_for(__import__("torch").device("cpu"), quick=True)
    assert p.memory_bandwidth == pytest.approx(fake.expected_memory_bandwidth(grid), rel=5e-3) and p.bandwidth_efficiency == 1.0
    assert p.kernel_floor_us == pytest.approx(fake.step_floor_s * 1e6)
    assert p.dtensor_op_us == pytest.approx(fake.dtensor_call_s * 1e6)  # what tensor-parallel CPU ranks pay per DTensor call
    assert (p.fsdp_unit_us, p.fsdp_collective_us, p.fsdp_param_us) == pytest.approx([fake.fsdp_s[k] * 1e6 for k in FSDP_COSTS])
    assert p.memory_bytes == fake.memory_bytes
    # item 3 of issue 29: the host keys are measured (the CPU's host is the device), not dropped
    assert p.host_memory_bytes == fake.memory_bytes
    assert p.host_memory_bandwidth == pytest.approx(fake.copy_bandwidth, rel=5e-3)
    assert p.host_link_bandwidth == pytest.approx(fake.copy_bandwidth / 2, rel=5e-3)
    assert p.calibration["trusted"] is True and p.calibration["repeat_spread"] == 0
    assert sum(c == "matmul fp32" for c in fake.calls) == 3 * len(grid.matmul_shapes())  # three interleaved passes


def test_estimate_runs_at_the_measured_speed_and_checks_offload_against_the_measured_host(monkeypatch, tmp_path):
    slow, fast = tmp_path / "slow.yaml", tmp_path / "fast.yaml"
    for path, times in ((slow, 1.0), (fast, 2.0)):
        machine = FakeMachine(
            rates={d: r * times for d, r in FakeMachine().rates.items()},
            attention=1e11 * times,
            memory_bandwidth=3e10 * times,
            copy_bandwidth=1.2e10 * times,
            floor_s=1e-9,
            step_floor_s=1e-9,
        )
        with monkeypatch.context() as mp:
            machine.install(mp)
            assert runner.invoke(app, ["calibrate", "--quick", "--out", str(path)]).exit_code == 0
    a, b = _estimate(f"cluster.accelerator={slow}"), _estimate(f"cluster.accelerator={fast}")
    assert b.step_s / a.step_s == pytest.approx(0.5, rel=0.05)  # twice the speed measured: half the step
    offloaded = _estimate(f"cluster.accelerator={slow}", "parallel.offload=states", "parallel.zero=3")
    assert offloaded.host.node_capacity == 24 * GIB  # the built-in's 64 devices x 2 x memory would be 3,072 GiB
    assert offloaded.job.profile.host_memory_bandwidth == pytest.approx(1.2e10, rel=5e-3)


def test_two_gloo_ranks_measure_collectives_into_the_profile(quiet, tmp_path, monkeypatch):
    out, measured = tmp_path / "two.yaml", []
    fit_comm = fit.fit_comm
    monkeypatch.setattr(fit, "fit_comm", lambda samples: measured.extend(samples) or fit_comm(samples))
    result = runner.invoke(app, ["calibrate", "--quick", "cluster.devices_per_node=2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):  # the timings grow with the bytes
        sizes = sorted((s.nbytes, s.seconds) for s in measured if s.op == op)
        assert len(sizes) >= 2 and sizes[-1][1] > sizes[0][1], (op, sizes)
    ((latency, bandwidth),) = fit_comm(measured).values()  # what the profile must hold: the fit of what was timed
    written = get_profile(str(out))
    assert written.intra_node_bandwidth * written.comm_efficiency == pytest.approx(bandwidth, rel=1e-2)
    assert written.comm_latency_us == pytest.approx(latency * 1e6, rel=1e-2)
    data = yaml.safe_load(out.read_text())
    assert data["calibration"]["ranks"] == 2 and data["calibration"]["threads"] == cpu_threads(2)
    assert data["comm_sync_us"] >= 0 and "comm_sync_share" not in data  # fitted from the tensor-parallel probe steps
    profile = get_profile(str(out))
    assert profile.comm_latency_us >= 0 and 0 < profile.comm_efficiency <= 1
    assert (
        profile.intra_node_bandwidth * profile.comm_efficiency
        != get_profile("cpu").intra_node_bandwidth * get_profile("cpu").comm_efficiency
    )
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        assert op in result.output
    assert "busbw" in result.output
    dp2 = _estimate("parallel=dp2", f"cluster.accelerator={out}")
    assert dp2.step_s > 0


@pytest.mark.parametrize("make", ["txt", "dir", "under_file"])
def test_a_bad_out_path_is_refused_before_measuring(tmp_path, make, fake):
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
    assert not out.is_file() and not fake.calls


def test_an_llmforge_home_that_is_a_file_is_named_not_out(tmp_path, monkeypatch, fake):
    home = tmp_path / "home"
    home.write_text("not a folder")
    monkeypatch.setenv("LLMFORGE_HOME", str(home))
    result = runner.invoke(app, ["calibrate", "--quick"])
    assert result.exit_code == 2, result.output
    assert "LLMFORGE_HOME" in result.output and "--out =" not in result.output and "Traceback" not in result.output
    assert not fake.calls and home.read_text() == "not a folder"


@pytest.mark.parametrize("name", ["../x", "a/b", "/tmp/x", ".hidden", "x.yaml", "my card", ""])
def test_a_name_that_is_not_a_plain_name_is_refused(tmp_path, monkeypatch, fake, name):
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path / "home"))
    result = runner.invoke(app, ["calibrate", "--quick", "--name", name])
    assert result.exit_code == 2, result.output
    assert "--name" in result.output and "Traceback" not in result.output
    assert not fake.calls and not list(tmp_path.rglob("*.yaml"))


def test_a_named_profile_is_written_where_its_printed_selection_finds_it(tmp_path, monkeypatch, fake):
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path / "home"))
    forget_profiles()
    result = runner.invoke(app, ["calibrate", "--quick", "--name", "my-cpu.v2"])
    assert result.exit_code == 0, result.output
    assert "cluster.accelerator=my-cpu.v2" in result.output
    assert (tmp_path / "home" / "profiles" / "my-cpu.v2.yaml").is_file()
    assert get_profile("my-cpu.v2").peak("fp32") == pytest.approx(fake.rates["fp32"], rel=5e-3)
    forget_profiles()


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
    forget_profiles()
    try:
        assert get_profile("h100-80gb").calibrated
    finally:
        monkeypatch.delenv("LLMFORGE_HOME")
        forget_profiles()
    assert not get_profile("h100-80gb").calibrated


def test_the_first_cpu_run_calibrates_once_and_estimate_reads_the_cache_without_torch(quiet, tmp_path, small_data, monkeypatch):
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
