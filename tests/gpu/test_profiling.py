"""Profiling on a GPU: the trace holds CUDA kernels, train.memory_snapshot=profile writes a
snapshot, and an out-of-memory error ends in one message naming the snapshot and the
estimate for the plan (exit code 2), through torchrun as multi-GPU runs go."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch
from gpu_support import child_env, llmforge

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.ffn_hidden_size=128",
    "model.vocab_size=512",
    "model.seq_len=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.steps=4",
    "train.log_interval=1",
    "precision.param_dtype=bf16",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "cluster.accelerator=h100-80gb",
]


def test_trace_has_cuda_kernels_and_the_memory_snapshot_is_written(tmp_path, small_data):
    run_dir = tmp_path / "run"
    llmforge(
        [
            "pretrain",
            *SMALL,
            *small_data,
            "cluster.launcher=torchrun",
            "train.profile=2-3",
            "train.memory_snapshot=profile",
            f"run.dir={run_dir}",
        ]
    )
    trace = json.loads((run_dir / "profile" / "rank0.steps2-3.pt.trace.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
    snapshot = pickle.loads((run_dir / "profile" / "memory_step3_rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]


def test_out_of_memory_names_the_snapshot_and_the_estimate(tmp_path, small_data):
    run_dir = tmp_path / "run"
    # A 48k-token microbatch through a 32k vocabulary: the logits alone need ~6 GiB in fp32.
    huge = ["model.vocab_size=32768", "model.seq_len=2048", "train.micro_batch_size=24", "train.global_batch_size=24"]
    args = [*SMALL, *small_data, *huge, "cluster.launcher=local", f"run.dir={run_dir}", "--force"]
    env = child_env(PYTORCH_CUDA_ALLOC_CONF="", LLMFORGE_TEST_MEMORY_FRACTION="0.03")
    proc = subprocess.run([sys.executable, "-c", LIMITED, *args], env=env, capture_output=True, text=True, timeout=600)
    text = (proc.stdout + proc.stderr).replace("\n", " ")
    assert proc.returncode == 2, text[-4000:]
    assert "ran out of GPU memory in step 1" in text and f"llmforge estimate --plan {run_dir}/plan.json" in text
    assert "Traceback" not in text
    assert (run_dir / "profile" / "oom_step1_rank0.pickle").is_file()


# The CLI training in its own process (cluster.launcher=local) with that process's share of
# the GPU capped, so a small GPU and a large one both run out.
LIMITED = """
import os, sys, torch
torch.cuda.set_per_process_memory_fraction(float(os.environ["LLMFORGE_TEST_MEMORY_FRACTION"]))
from llmforge.cli import main
sys.argv = ["llmforge", "pretrain", *sys.argv[1:]]
main()
"""
