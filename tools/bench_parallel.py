"""Tokens/s of each parallel layout on this machine, relative to one process.

    python tools/bench_parallel.py [--steps 6]

Runs the harness model (llmforge.parallel.harness) single-process, then every
2-rank and 4-rank layout under torchrun, and prints one table. The first step
(warm-up, pipeline shape inference) is left out of the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from llmforge.parallel.harness import tiny_plan, train_layout

LAYOUTS = {
    2: {
        "dp2": ["parallel.dp=2"], "dp2 zero3": ["parallel.dp=2", "parallel.zero=3"], "tp2": ["parallel.tp=2"],
        "tp2 sp": ["parallel.tp=2", "parallel.sequence_parallel=true"], "pp2 1f1b": ["parallel.pp=2"],
        "pp2 interleaved v2": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"],
    },
    4: {"dp2 tp2": ["parallel.dp=2", "parallel.tp=2"], "dp2 pp2": ["parallel.dp=2", "parallel.pp=2"], "tp2 pp2": ["parallel.tp=2", "parallel.pp=2"]},
}
BENCH = ["model.hidden_size=128", "model.ffn_hidden_size=512", "model.seq_len=128", "model.vocab_size=1024", "train.global_batch_size=16", "train.micro_batch_size=4"]


def tokens_per_s(times: list, *, tokens: int) -> float:
    return tokens / statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    base = BENCH + [f"train.steps={args.steps}"]
    tokens = tiny_plan(base).tokens_per_step
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    single = tokens_per_s(train_layout(tiny_plan(base)).step_times, tokens=tokens)
    rows = [("single", 1, single)]
    with tempfile.TemporaryDirectory() as tmp:
        for nproc, layouts in LAYOUTS.items():
            spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.pt"
            spec.write_text(json.dumps({"base": base, "layouts": layouts}))
            threads = str(max(1, (os.cpu_count() or 1) // nproc))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "llmforge.parallel.harness", str(spec), str(out)]
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": threads})
            for name, result in torch.load(out, weights_only=False).items():
                rows.append((name, nproc, tokens_per_s(result["step_times"], tokens=tokens)))
    print(f"{'layout':<22} {'ranks':>5} {'tokens/s':>10} {'vs single':>10}")
    for name, ranks, tps in rows:
        print(f"{name:<22} {ranks:>5} {tps:>10.0f} {tps / single:>9.2f}x")


if __name__ == "__main__":
    main()
