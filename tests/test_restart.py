"""Automatic restart: a dp2 run whose rank 1 dies mid-run (LLMFORGE_FAULT) is restarted by
torchrun (cluster.max_restarts) and finishes with an uninterrupted run's numbers. The
same run shows validation on real data and the profiler trace of every rank under dp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmforge.config.compose import compose
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
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_interval=1",
    "checkpoint.interval=2",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=2",
    "data.val_fraction=0.05",
    "train.eval_interval=2",
    "train.eval_steps=2",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    tmp = tmp_path_factory.mktemp("restart")
    reference = tmp / "reference"
    run(RunPlan.build(compose([*TINY, *small_data, f"run.dir={reference}"])), rank=RankInfo())
    restarted = tmp / "restarted"
    args = [*TINY, *small_data, "parallel=dp2", "cluster.max_restarts=1", "train.profile=2-2", f"run.dir={restarted}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300", "LLMFORGE_FAULT": "1:3"}  # rank 1 dies after step 3
    proc = subprocess.run([sys.executable, "-m", "llmforge", "pretrain", *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return reference, restarted, proc.stdout + proc.stderr


def test_the_restarted_ranks_resume_from_the_newest_complete_checkpoint(runs):
    _, restarted, output = runs
    assert f"restart 1 of 1 after a failed rank: resuming from {restarted}/checkpoints/step_2" in output.replace("\n", "")
    assert "done dp2 step 6" in output


def test_the_run_finishes_with_the_uninterrupted_runs_numbers(runs):
    reference, restarted, _ = runs
    got, ref = read_metrics(restarted / "metrics.jsonl"), {r["step"]: r for r in read_metrics(reference / "metrics.jsonl")}
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # step 3 trained again once, logged once
    for record in got:  # dp2 against one process: the same losses and held-out losses
        want = ref[record["step"]]
        assert record["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert ("val_loss" in record) == ("val_loss" in want) == (record["step"] % 2 == 0)
        if "val_loss" in record:
            assert record["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    # no sample skipped or repeated: both data streams end where the uninterrupted run's do
    state = [json.loads((d / "checkpoints" / "step_6" / "train_state.json").read_text()) for d in (restarted, reference)]
    assert [s["sampler"]["position"] for s in state] == [6 * 8, 6 * 8]
    assert [s["val_sampler"]["position"] for s in state] == [3 * 2 * 8, 3 * 2 * 8]


def test_every_rank_writes_its_profiler_trace(runs):
    _, restarted, _ = runs
    for rank in (0, 1):
        trace = json.loads((restarted / "profile" / f"rank{rank}.steps2-2.pt.trace.json").read_text())
        assert any(e.get("name", "").startswith("ProfilerStep#") for e in trace["traceEvents"])
