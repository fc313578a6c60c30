"""Layouts trained on real gloo ranks: ``llmforge.testing.harness`` under torchrun, one CPU
process per rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def run_harness(folder: Path, spec: dict, *, nproc: int, name: str = "run") -> dict:
    """The harness's results for ``spec`` (its ``base`` overrides, ``layouts`` and options) on
    ``nproc`` ranks, its files named ``name`` in ``folder``. A rank that a signal ended fails the
    test as "terminated with signal", the one failure the suite tries again (``conftest.py``); any
    other failure shows the ranks' errors."""
    spec_file, out = folder / f"{name}.json", folder / f"{name}.pt"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "llmforge.testing.harness"]
    proc = subprocess.run(
        [*cmd, str(spec_file), str(out)], capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if proc.returncode != 0:
        # torchrun names the first rank to fail last; the others it ended itself (SIGTERM)
        root = re.search(r"exitcode\s*:\s*(-?\d+)", proc.stderr.rpartition("Root Cause")[2])
        if root and int(root.group(1)) < 0:
            pytest.fail(f"a rank terminated with signal {-int(root.group(1))}: {proc.stderr[-2000:]}")
        raise AssertionError(proc.stderr[-4000:])
    return torch.load(out, weights_only=False)
