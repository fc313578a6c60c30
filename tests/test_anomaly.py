"""Non-finite steps never reach the weights (train.anomaly): the drills of each policy on one
process, dp2 ZeRO-3, tp2 and pp2, each against a reference that skips the same batches by hand.

- skip: a NaN injected at step 3 on one rank gives the final weights of a run without step 3's update;
- rollback: a clean step 3, NaN at steps 4-5 (one skip allowed) rolls back to step_2 at step 5: the
  final weights of a run resumed from step_2 past batches 3-5, at half the learning rate;
- stop: NaN at step 4 ends the run at step 4 naming the step, with step_2 intact and the weights
  of step 3 (step 4's update withheld).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmforge.testing.drill import run_drill
from llmforge.testing.harness import tiny_plan

STEPS = ["train.steps=7", "checkpoint.interval=2", "checkpoint.keep=5"]
LAYOUTS = {
    "dp2_zero3": (["parallel.dp=2", "parallel.zero=3"], "1", "nan-grad"),
    "tp2": (["parallel.tp=2"], "1", "nan-loss"),
    "pp2": (["parallel.pp=2"], "0", "nan-grad"),
}


def drills(layout: list, *, rank: str, kind: str, folder: Path) -> dict:
    """The five runs of one layout: each policy's drill and the references."""
    base = layout + STEPS
    return {
        "skip": {"overrides": base + ["train.anomaly=skip"], "fault": f"{rank}:3:{kind}"},
        "skip_ref": {"overrides": base, "skip": [3, 3]},
        "rollback": {
            "overrides": base + ["train.anomaly=rollback", "train.max_skipped_steps=1", "train.rollback_lr_factor=0.5"],
            "fault": f"{rank}:4-5:{kind}",
            "checkpoints": str(folder / "rollback"),
        },
        "rollback_ref": {"overrides": base, "skip": [3, 5], "lr_factor": 0.5},
        "stop": {"overrides": base + ["train.anomaly=stop"], "fault": f"{rank}:4:{kind}", "checkpoints": str(folder / "stop")},
        "stop_ref": {"overrides": base, "skip": [4, 7]},  # the weights after step 3: step 4's update withheld
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every layout's drills: the one-process ones here, the others in one 2-rank group."""
    tmp = tmp_path_factory.mktemp("anomaly")
    out = {}
    for name, spec in drills([], rank="0", kind="nan-loss", folder=tmp / "single").items():
        out[f"single/{name}"] = run_drill(tiny_plan(spec["overrides"]), spec, device=torch.device("cpu"))
    layouts = {
        f"{layout}/{name}": spec
        for layout, (overrides, rank, kind) in LAYOUTS.items()
        for name, spec in drills(overrides, rank=rank, kind=kind, folder=tmp / layout).items()
    }
    spec_file, result_file = tmp / "spec.json", tmp / "out.pt"
    spec_file.write_text(json.dumps({"layouts": layouts}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "llmforge.testing.drill",
        str(spec_file),
        str(result_file),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out.update(torch.load(result_file, weights_only=False))
    return {"runs": out, "tmp": tmp}


ALL = ["single", *LAYOUTS]


def assert_same_params(got: dict, want: dict, *, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=rtol / 100, msg=name)


@pytest.mark.parametrize("layout", ALL)
def test_skip_leaves_the_weights_of_a_run_without_that_steps_update(results, layout):
    runs = results["runs"]
    skip = runs[f"{layout}/skip"]
    assert skip["error"] == ""
    assert [r["skipped_steps"] for r in skip["records"]] == [0, 0, 1, 1, 1, 1, 1]
    assert_same_params(skip["params"], runs[f"{layout}/skip_ref"]["params"])


@pytest.mark.parametrize("layout", ALL)
def test_rollback_leaves_the_weights_of_a_run_resumed_past_the_bad_batches(results, layout):
    runs, folder = results["runs"], results["tmp"] / layout / "rollback"
    got = runs[f"{layout}/rollback"]
    assert got["error"] == ""
    said = got["said"][0]
    assert len(got["said"]) == 1 and said.startswith("rollback 1 of 3 at step 5: at step 4 the ")
    assert said.endswith(
        f"2 steps in a row were skipped (steps 4-5), more than train.max_skipped_steps=1. Reloaded {folder}/step_2 "
        "and skipped the 3 batches of steps 3-5; learning rate x0.5 from now on"
    )
    assert_same_params(got["params"], runs[f"{layout}/rollback_ref"]["params"])
    assert [r["lr"] for r in got["records"]][-1] == pytest.approx(0.5e-3)
    assert got["records"][-1]["rollbacks"] == 1 and got["records"][-1]["rollback_skipped_batches"] == 3
    # the checkpoint saved during the bad steps is set aside, the good ones stay
    assert sorted(p.name for p in folder.iterdir()) == ["diverged-step_4", "step_2", "step_6", "step_7"]


@pytest.mark.parametrize("layout", ALL)
def test_stop_ends_at_the_bad_step_and_names_the_way_on(results, layout):
    runs, folder = results["runs"], results["tmp"] / layout / "stop"
    error = runs[f"{layout}/stop"]["error"]
    assert "stopped at step 4: at step 4 the " in error and "train.anomaly=stop ends the run" in error
    assert f"llmforge resume ckpt={folder}/step_2" in error
    assert sorted(p.name for p in folder.iterdir()) == ["step_2"]
    assert [r["step"] for r in runs[f"{layout}/stop"]["records"]] == [1, 2, 3, 4]
    assert_same_params(runs[f"{layout}/stop"]["params"], runs[f"{layout}/stop_ref"]["params"])  # step 4 updated nothing


def test_fused_adamw_skips_on_the_device_without_a_host_read(monkeypatch):
    """The GPU path (fused AdamW, found_inf), on CPU: a NaN at unlogged step 3 costs no read."""
    monkeypatch.setattr("llmforge.train.optim.implementation", lambda params, **_: "fused")
    fused_skip_without_a_read(torch.device("cpu"))


def fused_skip_without_a_read(device: torch.device) -> None:
    """A NaN gradient at unlogged step 3 under fused AdamW: no host read on that step, the
    step count and weights of a run without step 3's update."""
    from llmforge.testing.harness import SyntheticSampler, full_parameters, rank_info
    from llmforge.train.build import build_components
    from llmforge.train.callbacks import Recorder
    from llmforge.train.instrument import inject_fault
    from llmforge.train.loop import train_loop
    from llmforge.train.syncs import StepSyncs

    plan = tiny_plan(["train.steps=5", "model.num_layers=1"])
    torch.manual_seed(plan.config.train.seed)
    m = plan.config.model
    c = build_components(
        plan,
        rank=rank_info(plan, device=device),
        sampler=SyntheticSampler(vocab_size=m.vocab_size, seq_len=m.seq_len, global_batch_size=8, seed=plan.config.train.seed),
    )
    assert c.optimizer.defaults["fused"]
    recorder = Recorder()
    c, fault = inject_fault(c, spec="0:3:nan-grad")
    syncs = StepSyncs(host=c.host_tensors)
    with syncs:
        train_loop(
            c, start_step=0, total_steps=5, grad_clip=0.5, log_interval=2, checkpoint_interval=0, callbacks=[recorder, *fault, syncs]
        )
    records = recorder.records
    assert syncs.per_step == [1, 0, 1, 1]  # steps 2-5: 2, 4 and 5 log; 3 (the NaN) reads nothing
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(2, 0), (4, 1), (5, 1)]
    assert all(float(s["step"]) == 4 for s in c.optimizer.state.values())  # step 3 not counted
    reference = run_drill(plan, {"skip": [3, 3]}, device=device)
    assert_same_params(full_parameters(c), reference["params"], rtol=1e-5 if device.type == "cpu" else 1e-4)


def test_fp16_overflow_is_the_scalers_until_its_floor():
    from llmforge.parallel.clip import GlobalClip
    from llmforge.train.anomaly import AnomalyPolicy, StepGuard
    from llmforge.train.guarded_step import GuardedOptimizerStep
    from llmforge.train.precision import LossScaler

    scaler = LossScaler(scale=4.0, growth_interval=1000, enabled=True)
    guard = StepGuard(AnomalyPolicy(action="skip", max_skipped_steps=10), device=torch.device("cpu"))
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], foreach=False)
    update = GuardedOptimizerStep(optimizer, scaler=scaler, guard=guard)
    scales, skipped = [], []
    for step in range(1, 5):
        param.grad = torch.full((3,), float("inf"))  # an fp16 overflow
        loss = torch.tensor(2.0)
        flags = guard.local_flags(loss)
        ok = guard.verdict(step=step, loss=loss, grad_norm=GlobalClip(params=[param])(1.0, flags=flags), flags=flags)
        update(ok)
        scales.append(scaler.scale)
        skipped.append(guard.read().metrics["skipped_steps"])
    assert scales == [2.0, 1.0, 1.0, 1.0] and skipped == [0, 0, 1, 2]  # at the floor, an overflow is an anomaly
    assert torch.equal(param.detach(), torch.ones(3)) and not optimizer.state


def test_a_loss_spike_is_flagged_and_can_be_skipped():
    from llmforge.train.anomaly import AnomalyPolicy, StepGuard

    for skip in (False, True):
        guard = StepGuard(AnomalyPolicy(spike_window=4, spike_sigma=3.0, spike_skip=skip), device=torch.device("cpu"))
        oks = []
        for step, value in enumerate([2.0, 2.1, 1.9, 2.0, 2.05, 9.0, 2.0], start=1):
            loss = torch.tensor(value)
            flags = guard.local_flags(loss)
            oks.append(bool(guard.verdict(step=step, loss=loss, grad_norm=torch.tensor(1.0, dtype=torch.float64), flags=flags)))
        reading = guard.read()
        assert reading.metrics["loss_spike"] == 1  # step 6 only: the window needs 4 steps first
        assert oks == [True] * 5 + [not skip, True]
        assert reading.metrics["skipped_steps"] == int(skip)


def test_rotation_keeps_the_newest_checkpoint_before_the_first_anomaly(tmp_path):
    from llmforge.checkpoint.store import rotate

    for step in (2, 4, 6, 8, 10):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "manifest.json").write_text("{}")
    removed = rotate(tmp_path, keep=2, protect=[5])
    assert sorted(p.name for p in removed) == ["step_2", "step_6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_4", "step_8"]


def test_the_policy_keys_are_checked_together():
    from llmforge.errors import UserError

    with pytest.raises(UserError) as info:
        tiny_plan(["train.anomaly=retry", "train.max_skipped_steps=-1", "train.rollback_lr_factor=2", "train.loss_spike_window=-1"])
    text = info.value.message()
    for key in ("train.anomaly", "train.max_skipped_steps", "train.rollback_lr_factor", "train.loss_spike_window"):
        assert key in text


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path, small_data):
    """train.lr=1e4: the gradient norm turns NaN within a few steps. The default policy skips up
    to train.max_skipped_steps, then stops with exit code 2 and the resume command; no checkpoint
    holds a non-finite number and rotation kept the newest one before the first anomaly."""
    from typer.testing import CliRunner

    from llmforge.checkpoint.export import read_model_weights
    from llmforge.cli import app

    run_dir = tmp_path / "run"
    args = [
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.num_heads=2",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=64",
        "model.seq_len=32",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
        "train.steps=12",
        "train.lr=1e4",
        "optim.warmup_steps=0",
        "checkpoint.interval=1",
        "checkpoint.keep=2",
        "logging.console=false",
        "logging.wandb.mode=disabled",
        f"run.dir={run_dir}",
    ]
    result = CliRunner().invoke(app, ["pretrain", *args, *small_data])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "training stopped on non-finite numbers: stopped at step " in text and "train.anomaly=skip then stops" in text
    first = int(text.split("in a row were skipped (steps ")[1].split("-")[0])
    assert f"llmforge resume ckpt={run_dir}/checkpoints/step_{first - 1}" in text
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert first - 1 in saved and len(saved) == 3  # keep=2, and the newest before the first anomaly
    for step in saved:
        assert all(torch.isfinite(t).all() for t in read_model_weights(run_dir / "checkpoints" / f"step_{step}").values())


def test_non_finite_weights_are_never_saved():
    from llmforge.train.anomaly import Anomaly, AnomalyPolicy, StepGuard, check_weights

    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.tensor([1.0, float("inf")]))]
    for action, expected in (("skip", "stop"), ("rollback", "rollback")):
        with pytest.raises(Anomaly) as info:
            check_weights(
                StepGuard(AnomalyPolicy(action=action), device=torch.device("cpu")),
                params,
                step=6,
                distributed=False,
                device=torch.device("cpu"),
            )
        assert info.value.action == expected and "weights were non-finite" in str(info.value)
    check_weights(StepGuard(AnomalyPolicy(), device=torch.device("cpu")), params[:1], step=6, distributed=False, device=torch.device("cpu"))
