"""A one-device compute calibration in a child process of its own.

A run that measures its CPU first (``llmforge.calibrate.auto``) would otherwise keep, through
training, what the probes leave behind: the math libraries' per-thread buffers, the allocator's
arenas, the attention kernels' caches (about 0.2 GiB of resident memory on the default recipe's
first run, all of it in the run's peak). The child measures and writes its timings as JSON; the
parent reads them back.

    python -m llmforge.calibrate.apart --out SAMPLES.json --threads N [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from llmforge.calibrate import compute
from llmforge.calibrate.fit import ComputeSamples, compute_from_dict
from llmforge.calibrate.trust import PASSES
from llmforge.files import write_text_atomic


def measure_apart(*, quick: bool, threads: int, passes: int = PASSES, timeout_s: float = 600.0) -> ComputeSamples:
    """``llmforge.calibrate.compute.measure`` of this machine's CPU in a child process."""
    with tempfile.TemporaryDirectory(prefix="llmforge-calibrate-") as folder:
        out = Path(folder) / "samples.json"
        args = [sys.executable, "-m", "llmforge.calibrate.apart", "--out", str(out), "--threads", str(threads), "--passes", str(passes)]
        done = subprocess.run([*args, *(["--quick"] if quick else [])], capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"the CPU calibration's process failed (exit code {done.returncode}):\n{tail}")
        return compute_from_dict(json.loads(out.read_text(encoding="utf-8")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmforge.calibrate.apart")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--passes", type=int, default=PASSES)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)

    samples = compute.measure(torch.device("cpu"), quick=args.quick, threads=args.threads, tick=lambda what: None, passes=args.passes)
    write_text_atomic(args.out, json.dumps(asdict(samples)))


if __name__ == "__main__":
    main()
