"""Whole runs of one rank through torchrun (``cluster.launcher=torchrun``), as every
multi-GPU run goes: the in-process run's losses, checkpoints saved in the foreground
and the background, resume, SIGTERM, export to transformers, and a failing rank."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_support import DEVICES, LOW_PRECISION_REL, accelerator, child_env, llmforge, losses

pytestmark = pytest.mark.gpu

SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.ffn_hidden_size=128",
    "model.vocab_size=512",
    "model.seq_len=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_interval=1",
    "optim.warmup_steps=2",
    "precision.param_dtype=bf16",
    "checkpoint.interval=3",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
]


def plan_args(device: str, small_data: list, run_dir: Path, *extra: str) -> list:
    return [*SMALL, *small_data, f"cluster.accelerator={accelerator(device)}", *extra, f"run.dir={run_dir}"]


def close(a: dict, b: dict, steps) -> bool:
    return all(abs(a[s] - b[s]) <= LOW_PRECISION_REL * abs(b[s]) for s in steps)


@pytest.fixture(scope="module", params=DEVICES)
def runs(request, tmp_path_factory, small_data):
    """One plan trained four ways: through torchrun saving in the foreground, in this
    process, through torchrun saving in the background, and resumed at step 3."""
    device = request.param
    tmp = tmp_path_factory.mktemp(f"runs-{device}")
    dirs = {name: tmp / name for name in ("sync", "local", "async", "resumed")}
    llmforge(["pretrain", *plan_args(device, small_data, dirs["sync"], "cluster.launcher=torchrun")])
    llmforge(["pretrain", *plan_args(device, small_data, dirs["local"], "cluster.launcher=local")])
    llmforge(["pretrain", *plan_args(device, small_data, dirs["async"], "cluster.launcher=torchrun", "checkpoint.async=true")])
    resumed = llmforge(["resume", f"ckpt={dirs['sync'] / 'checkpoints' / 'step_3'}", f"run.dir={dirs['resumed']}"])
    return device, dirs, resumed.stdout + resumed.stderr


def test_through_torchrun_the_losses_are_those_of_the_in_process_run(runs):
    _, dirs, _ = runs
    got, ref = losses(dirs["sync"]), losses(dirs["local"])
    assert sorted(got) == list(range(1, 7)) and got[6] < got[1]
    assert close(got, ref, range(1, 7)), (got, ref)
    assert json.loads((dirs["sync"] / "plan.json").read_text())["config"]["cluster"]["launcher"] == "torchrun"


def test_checkpoints_are_complete_in_the_foreground_and_background(runs):
    _, dirs, _ = runs
    for name in ("sync", "async"):
        folder = dirs[name] / "checkpoints"
        assert sorted(p.name for p in folder.iterdir()) == ["step_3", "step_6"], name
        for step in (3, 6):
            assert (folder / f"step_{step}" / "manifest.json").is_file()
            assert json.loads((folder / f"step_{step}" / "train_state.json").read_text())["step"] == step
    assert close(losses(dirs["async"]), losses(dirs["sync"]), range(1, 7))


def test_resume_through_torchrun_continues_with_the_uninterrupted_losses(runs):
    _, dirs, output = runs
    got, full = losses(dirs["resumed"]), losses(dirs["sync"])
    assert sorted(got) == [4, 5, 6], output
    assert close(got, full, (4, 5, 6)), (got, full)


def test_the_export_loads_in_transformers_on_the_device_with_the_same_logits(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from llmforge.checkpoint.export import read_model_weights
    from llmforge.models.gpt import GPT
    from llmforge.plan import RunPlan

    device, dirs, _ = runs
    ckpt = dirs["async"] / "checkpoints" / "step_6"
    llmforge(["export", f"ckpt={ckpt}", "--out", str(tmp_path / "hf")])
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, torch_dtype=torch.float32)
        .to(device)
        .eval()
    )
    model = GPT(RunPlan.load(dirs["async"] / "plan.json").config.model)
    model.load_state_dict(read_model_weights(ckpt))
    model = model.to(device).eval()
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(input_ids=tokens).logits
    assert theirs.device.type == device and ours.abs().max() > 0.1
    torch.testing.assert_close(theirs, ours, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_sigterm_through_torchrun_saves_and_exits_zero(device, tmp_path, small_data):
    run_dir = tmp_path / "run"
    args = plan_args(device, small_data, run_dir, "cluster.launcher=torchrun", "train.steps=100000", "checkpoint.interval=0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmforge", "pretrain", *args], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-4000:]
    last = max(losses(run_dir))
    assert 2 <= last < 100000
    assert f"llmforge resume ckpt={run_dir}" in output.replace("\n", "")
    saved = run_dir / "checkpoints" / f"step_{last}"
    assert (saved / "manifest.json").is_file()
    assert json.loads((saved / "train_state.json").read_text())["step"] == last


@pytest.mark.parametrize("device", DEVICES)
def test_a_rank_that_raises_after_training_ends_the_job_with_its_error_once(device, tmp_path):
    """The rank trains a layout (collectives on its device), then raises: the job ends
    and the launcher shows the error once (a hang would run into the timeout)."""
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "base": [f"cluster.accelerator={accelerator(device)}"],
                "layouts": {"first": [], "second": []},
                "device": device,
                "mesh_of_one": True,
                "fail_rank": 0,
                "fail_at": "second",
            }
        )
    )
    argv = [
        "--standalone",
        "--nproc-per-node=1",
        "--monitor-interval=0.2",
        "-m",
        "llmforge.testing.harness",
        str(spec),
        str(tmp_path / "out.pt"),
    ]
    script = (
        "import sys; from rich.console import Console; from llmforge.processes.torchrun import run_torchrun; run_torchrun(sys.argv[1:], "
        "console=Console(width=300))"
    )
    proc = subprocess.run([sys.executable, "-c", script, *argv], env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 failed" in proc.stdout
    assert (proc.stdout + proc.stderr).count("RuntimeError: injected failure on this rank") == 1
    assert not (tmp_path / "out.pt").exists()
