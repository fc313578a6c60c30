"""Resume: bit-identical losses, same samples, overrides, refusals, preemption (one process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llmforge.checkpoint import store
from llmforge.checkpoint.resume import plan_for_resume
from llmforge.config.compose import compose
from llmforge.data.sampler import BatchSampler
from llmforge.errors import UserError
from llmforge.observe.metrics import read_metrics
from llmforge.plan import RunPlan
from llmforge.train.components import RankInfo
from llmforge.train.run import run

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "model.dropout=0.1",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_interval=1",
    "checkpoint.interval=2",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=2",
]


class Recorder:
    """Records the sequence ids every next_batch call consumed."""

    def __init__(self, monkeypatch) -> None:
        self.ids: list = []
        original = BatchSampler.next_batch

        def next_batch(sampler, **kw):
            out = original(sampler, **kw)
            self.ids.append(sampler.last_sequence_ids.copy())
            return out

        monkeypatch.setattr(BatchSampler, "next_batch", next_batch)

    def take(self) -> np.ndarray:
        out, self.ids = np.concatenate(self.ids), []
        return out


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data):
    """An uninterrupted 6-step run saving every 2 steps, with the samples it consumed."""
    mp = pytest.MonkeyPatch()
    recorder = Recorder(mp)
    run_dir = tmp_path_factory.mktemp("reference")
    plan = RunPlan.build(compose([*TINY, *small_data, f"run.dir={run_dir}"]))
    run(plan, rank=RankInfo())
    ids = recorder.take()
    mp.undo()
    return run_dir, losses(run_dir), ids


def test_resume_into_another_folder_is_bit_identical(reference, tmp_path, monkeypatch):
    run_dir, expected, expected_ids = reference
    recorder = Recorder(monkeypatch)
    plan, path = plan_for_resume([f"ckpt={run_dir}/checkpoints/step_2", f"run.dir={tmp_path}"])
    assert path == run_dir / "checkpoints" / "step_2"
    summary = run(plan, rank=RankInfo(), resume_from=path)
    got = losses(tmp_path)
    assert sorted(got) == [3, 4, 5, 6]
    assert all(got[s] == expected[s] for s in got), (got, expected)  # bit-identical, not approximately
    assert np.array_equal(recorder.take(), expected_ids[2 * 8 :])
    assert summary.checkpoint == tmp_path / "checkpoints" / "step_6"


def test_resume_in_the_same_folder_appends_once(reference, tmp_path, monkeypatch):
    import shutil

    source, expected, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    plan, path = plan_for_resume([f"ckpt={run_dir}/checkpoints/step_4"])
    assert plan.run_dir == run_dir
    run(plan, rank=RankInfo(), resume_from=path)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "checkpoints" / "superseded-step_6").is_dir()  # the history resumed past
    assert [p.name for p in store.complete(run_dir / "checkpoints")][:1] == ["step_6"]
    assert [r["loss"] for r in records] == [expected[s] for s in range(1, 7)]


def test_changed_microbatching_consumes_the_same_samples(reference, tmp_path, monkeypatch):
    run_dir, expected, expected_ids = reference
    recorder = Recorder(monkeypatch)
    plan, path = plan_for_resume([f"ckpt={run_dir}/checkpoints/step_4", f"run.dir={tmp_path}", "train.micro_batch_size=2"])
    run(plan, rank=RankInfo(), resume_from=path)
    assert np.array_equal(recorder.take(), expected_ids[4 * 8 :])
    got = losses(tmp_path)
    # same weights and batch; only the dropout masks (drawn per microbatch) differ
    assert got[5] == pytest.approx(expected[5], rel=1e-2) and got[5] != expected[5]


def test_allowed_overrides_apply_and_fixed_ones_are_refused(reference, tmp_path):
    run_dir, *_ = reference
    plan, path = plan_for_resume(
        [f"ckpt={run_dir}/checkpoints/latest", "train.steps=9", "train.lr=1e-4", "checkpoint.async=true", f"run.dir={tmp_path}"]
    )
    assert path.name == "step_6"
    assert (plan.config.train.steps, plan.config.train.lr, plan.config.checkpoint.async_save) == (9, 1e-4, True)
    with pytest.raises(UserError) as err:
        plan_for_resume([f"ckpt={run_dir}", "model.hidden_size=64", "model.vocab_size=8192", "data.vocab_size=1000", "train.steps=9"])
    text = err.value.message()
    for key in ("model.hidden_size", "model.vocab_size", "data.vocab_size"):
        assert f"{key} = " in text and "cannot change on resume" in text
    with pytest.raises(UserError, match="already at step 6"):
        plan_for_resume([f"ckpt={run_dir}"])
    with pytest.raises(UserError, match="exactly one ckpt"):
        plan_for_resume(["train.steps=9"])


def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path, small_data):
    run_dir = tmp_path / "run"
    args = [*TINY, *small_data, "train.steps=500", "checkpoint.interval=0", f"run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmforge", "pretrain", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = run_dir / "metrics.jsonl"
    for _ in range(1200):
        if (metrics.is_file() and metrics.read_text().count("\n") >= 2) or proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    last = read_metrics(metrics)[-1]["step"]
    assert 2 <= last < 500
    assert f"llmforge resume ckpt={run_dir}" in output.replace("\n", "")
    assert json.loads((run_dir / "checkpoints" / f"step_{last}" / "train_state.json").read_text())["step"] == last


def test_cli_reports_a_damaged_checkpoint_with_exit_code_2(reference, tmp_path):
    import shutil

    from typer.testing import CliRunner

    from llmforge.cli import app

    run_dir = tmp_path / "run"
    shutil.copytree(reference[0] / "checkpoints" / "step_6", run_dir / "checkpoints" / "step_6")
    shard = next((run_dir / "checkpoints" / "step_6").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    runner = CliRunner()
    for args in (
        ["resume", f"ckpt={run_dir}/checkpoints/step_6", "train.steps=9"],
        ["export", f"ckpt={run_dir}/checkpoints/step_6", "--out", str(tmp_path / "hf")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert f"{shard.name}: truncated" in result.output.replace("\n", "") and "Traceback" not in result.output
    assert not (tmp_path / "hf").exists()
    result = runner.invoke(app, ["resume", f"ckpt={run_dir}", "train.steps=9"])  # latest: nothing intact left
    assert result.exit_code == 2 and "no complete checkpoint" in result.output.replace("\n", "")
