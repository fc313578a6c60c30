"""Automatic restart: a dp2 run whose rank 1 gets stuck in a collective mid-run (LLMFORGE_FAULT)
is found hung from its progress well before cluster.timeout_s, explained (who is behind, where
every rank is, stacks and flight recorder in the run folder), restarted by torchrun
(cluster.max_restarts) and finishes with an uninterrupted run's numbers. The same run names the
rank a drill slows before the hang (and none after the restart), and shows validation on real
data and the profiler trace of every rank under dp."""

from __future__ import annotations

import json
import logging
import os
import re
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
FLOOR_S = 4
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


WATCH = [
    "cluster.health.straggler_interval=2",
    "cluster.health.straggler_ratio=3",
    f"cluster.health.hang_floor_s={FLOOR_S}",
    "cluster.health.hang_long_s=120",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    tmp = tmp_path_factory.mktemp("restart")
    reference = tmp / "reference"
    run(RunPlan.build(compose([*TINY, *small_data, f"run.dir={reference}"])), rank=RankInfo())
    restarted = tmp / "restarted"
    args = [*TINY, *small_data, "parallel=dp2", "cluster.max_restarts=1", "train.profile=2-2", f"run.dir={restarted}", *WATCH]
    # rank 1 sleeps in steps 1-2, then at step 3 blocks in a receive no rank answers
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300", "LLMFORGE_FAULT": "1:1-2:slow,1:3:hang"}
    proc = subprocess.run([sys.executable, "-m", "llmforge", "pretrain", *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return reference, restarted, proc.stdout + proc.stderr


def test_a_rank_stuck_in_a_collective_is_found_within_its_bound_and_explained(runs):
    _, restarted, output = runs
    report = (restarted / "hangs" / "attempt0" / "report.txt").read_text()
    assert report in output.replace("\n\n", "\n") or report.splitlines()[0] in output
    silent, bound = map(float, re.search(r"made no progress for ([\d.]+) s \(bound ([\d.]+) s", report).groups())
    # the tiny step's estimate is milliseconds, so the floor sets the bound: far below cluster.timeout_s (300 s)
    assert bound == FLOOR_S and bound <= silent < bound + 3, report
    assert "behind: rank 1\n" in report
    assert re.search(r"rank 0: step 3, comm, .*waits in gloo:all_reduce #\d+ of process group 0, which rank 1 has not issued", report)
    assert re.search(r"rank 1: step 3, forward \(microbatch 0\), .*no collective under way", report)
    stacks = {rank: (restarted / "hangs" / "attempt0" / f"stack-rank{rank}.txt").read_text() for rank in (0, 1)}
    assert all("most recent call first" in text for text in stacks.values())
    assert "in recv" in stacks[1] and "llmforge/train/step.py" in stacks[0]
    assert "they restart from the newest complete checkpoint" in report


def test_torchs_analyser_reads_the_flight_recorder_and_names_the_missing_rank(runs, caplog):
    from torch.distributed.flight_recorder.fr_trace import main as analyse

    _, restarted, _ = runs
    with caplog.at_level(logging.INFO):
        analyse([str(restarted / "hangs" / "attempt0" / "flight_recorder")])
    said = caplog.text
    assert "Not all ranks joining collective" in said and "missing ranks: {1}" in said


def test_the_slowed_rank_is_named_in_the_first_report_and_none_after_the_restart(runs):
    _, restarted, output = runs
    first = next(r for r in read_metrics(restarted / "metrics.jsonl") if r["step"] == 2)
    assert first["straggler_rank"] == 1 and first["straggler_ratio"] > 3, first
    before, after = " ".join(output.split()).split("restart 1 of 1")
    named = r"straggler: rank 1 \(node \S+, device cpu\) computed [\d.]+ s per step over steps 1-2, [\d.]+x the other ranks' median"
    assert re.search(named, before), before
    assert "straggler:" not in after


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
