"""A CPU rank's memory: the estimate's terms (``llmforge.estimate.cpu_memory`` and the process
allowance) against what a tiny run's most-loaded rank holds, and the peak the closing line reads.
Memory only: nothing here depends on the machine's speed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmforge.commands.plans import build_plan
from llmforge.estimate.core import estimate_plan
from llmforge.estimate.cpu_memory import CPU_STEP_CODE_BYTES, cpu_step_bytes, heap_mmap_threshold
from llmforge.estimate.memory import allowance
from llmforge.processes.host_memory import return_freed_memory
from llmforge.rehearse.run import rehearse
from llmforge.train.meter import peak_rss_bytes, reset_peak_rss

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
ITEMS = ("weights", "grads", "optimizer", "activations", "transient")
#: The band the closing line's peak memory ratio must fall in: issue 30's target is 0.85-1.15, but
#: without the step terms (``cpu_step_bytes``, 48 MiB) these runs read 1.10-1.12, so 1.08 above.
LOW, HIGH = 0.85, 1.08


def _pretrain(run_dir: Path, small_data: list[str], *overrides: str) -> str:
    """A tiny run in its own process (this one holds pytest): its closing line."""
    args = [sys.executable, "-m", "llmforge", "pretrain", *small_data, f"run.dir={run_dir}", "logging.console=false", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return next(line for line in output.splitlines() if line.startswith("done "))


def _ratio(line: str) -> float:
    found = re.search(r"peak memory ([0-9.]+)x", line)
    assert found, line
    return float(found.group(1))


@pytest.fixture(scope="module")
def prepared(small_data) -> list[str]:
    """``small_data``, prepared here: a run that prepares data first keeps the libraries it imported
    for it (about 0.1 GiB: datasets, pyarrow), which the estimate does not count."""
    from rich.console import Console

    from llmforge.train.run import prepare_data

    prepare_data(build_plan(["recipe=tiny", *small_data]), console=Console(quiet=True))
    return small_data


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(["train.steps=6"], id="single"),
        pytest.param(["parallel=pp2", "cluster.devices_per_node=2", "train.steps=4"], id="pp2"),
    ],
)
def test_tiny_run_peaks_at_its_estimate(layout, tmp_path, prepared):
    """The most-loaded rank's peak resident memory over the estimate's per-rank total (pp2: stage 1,
    which rank 0 is not): within the band on one process and on a pipeline."""
    ratio = _ratio(_pretrain(tmp_path / "run", prepared, *layout))
    assert LOW <= ratio <= HIGH, f"peak memory {ratio}x the estimate"


def test_the_peak_restarts_from_what_the_process_holds():
    """Memory freed before a run (a calibration in the launcher's process) neither stays resident
    nor counts in the run's peak."""
    block = torch.ones(64 * MIB // 4)
    before = peak_rss_bytes()
    del block
    return_freed_memory()
    reset_peak_rss()
    assert peak_rss_bytes() < before - 32 * MIB


def test_step_terms_count_the_code_and_two_heap_blocks():
    """16 MiB of code, and two blocks of the heap's mmap threshold: the tiny recipe's logits
    (4 x 128 tokens x 4096 x fp32 = 8 MiB) put it at 16 MiB."""
    plan = build_plan(["recipe=tiny"])
    est = estimate_plan(plan)
    assert heap_mmap_threshold(tokens=4 * 128, widest=4096) == 16 * MIB
    assert cpu_step_bytes(est.shape, micro_batch=4) == CPU_STEP_CODE_BYTES + 32 * MIB
    w = est.worst
    assert w.reserved == pytest.approx(allowance(est.job, working=w.activations + w.transient) + CPU_STEP_CODE_BYTES + 32 * MIB)


def test_pipeline_last_stage_keeps_no_microbatch_logits():
    """The last stage's logits go with each microbatch's loss (the schedule returns no outputs):
    its rehearsed tensors are the estimate's, not 1.4 times them."""
    plan = build_plan(["recipe=tiny", "parallel=pp2", "cluster.devices_per_node=2"])
    est = estimate_plan(plan)
    assert est.worst.stage == 1
    rehearsed = rehearse(plan, stage=1).step_peak_bytes
    assert rehearsed / sum(getattr(est.worst, k) for k in ITEMS) < 1.1
