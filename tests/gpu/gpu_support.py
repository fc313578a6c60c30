"""Shared parts of the GPU suite. One GPU runs the distributed path (torchrun, the worker, a device
mesh, NCCL) that multi-GPU runs take, and compares with the in-process run.

    python -m pytest -m gpu tests/gpu

Every test is parametrised by device: ``cuda`` (skipped without CUDA) and, where
there is no GPU, ``cpu`` (the same checks under gloo, so the suite's logic runs anywhere). Ranks
run under the collective guard (tests/conftest.py sets LLMFORGE_CHECK_COLLECTIVES),
so on a GPU a CPU tensor handed to a collective fails the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DEVICES = [
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the suite runs on it")),
]
#: Relative tolerance of a low-precision run against another run of the same plan:
#: GPU kernels are not bit-deterministic, and bf16 rounds differences up.
LOW_PRECISION_REL = 2e-2


def accelerator(device: str) -> str:
    """The hardware profile for runs on ``device``."""
    return "cpu" if device == "cpu" else "h100-80gb"


def child_env(**extra: str) -> dict:
    """The environment of a launched process: this checkout first on the path (the
    GPU machine runs the project from its checkout, with wheels on PYTHONPATH)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "300", **extra}


def llmforge(args: list[str], *, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m llmforge ARGS`` in a fresh process; fails the test on a non-zero exit."""
    proc = subprocess.run([sys.executable, "-m", "llmforge", *args], env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def losses(run_dir: Path) -> dict:
    from llmforge.observe.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}
