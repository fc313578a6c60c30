"""Tokens/s of each parallel layout on this machine, relative to one process.

    python tools/bench_parallel.py [--steps 6] [--threads 1] [--only dp2 "dp2 tp2"]

Every layout, the single-process baseline included, is launched the same way: a
fresh ``torchrun`` group (``--nproc-per-node`` = the layout's ranks) running the
harness model (llmforge.testing.harness), each rank with ``--threads`` intra-op
threads (OMP_NUM_THREADS, MKL_NUM_THREADS and torch's own setting). A layout
with r ranks therefore uses r x threads threads in all, and the table says so.
The first step (warm-up, pipeline shape inference) is left out of the timing.
ZeRO-0 data-parallel layouts run twice: with the gradient all-reduce overlapped
with backward (the default) and, marked "post-backward", with one flat
all-reduce after it (``parallel.overlap_grad_reduce=false``), each in its own group.

Comparing against a baseline trained inside this process with every core's
worth of threads is not a fair comparison on a small model: torch's intra-op
thread pool costs more in synchronisation than it gains on these matrix sizes,
most of all when the cores are shared, so such a baseline looks several times
slower than it is.
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

from llmforge.testing.harness import tiny_plan

LAYOUTS: dict[int, dict[str, list[str]]] = {
    1: {"single": []},
    2: {
        "dp2": ["parallel.dp=2"],
        "dp2 zero3": ["parallel.dp=2", "parallel.zero=3"],
        "tp2": ["parallel.tp=2"],
        "tp2 sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
        "pp2 1f1b": ["parallel.pp=2"],
        "pp2 interleaved v2": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"],
    },
    4: {
        "dp2 tp2": ["parallel.dp=2", "parallel.tp=2"],
        "dp2 pp2": ["parallel.dp=2", "parallel.pp=2"],
        "tp2 pp2": ["parallel.tp=2", "parallel.pp=2"],
    },
}
# Layouts run again with the reduction after backward, to compare with the overlap.
POST_BACKWARD: dict[int, dict[str, list[str]]] = {
    2: {"dp2 post-backward": ["parallel.dp=2", "parallel.overlap_grad_reduce=false"]},
    4: {"dp2 tp2 post-backward": ["parallel.dp=2", "parallel.tp=2", "parallel.overlap_grad_reduce=false"]},
}
BENCH = [
    "parallel.overlap_grad_reduce=true",
    "model.hidden_size=128",
    "model.ffn_hidden_size=512",
    "model.seq_len=128",
    "model.vocab_size=1024",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
]
Row = tuple[str, int, float, list[int]]


def tokens_per_s(times: list, *, tokens: int) -> float:
    return tokens / statistics.median(times[1:])


def run_group(
    *, nproc: int, layouts: dict[str, list[str]], base: list[str], threads: int, tmp: Path, extra_env: dict[str, str]
) -> dict[str, dict]:
    """Run ``layouts`` in one fresh torchrun group of ``nproc`` ranks; rank 0's results."""
    spec, out = tmp / f"spec{nproc}.json", tmp / f"out{nproc}.pt"
    spec.write_text(json.dumps({"base": base, "layouts": layouts}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "llmforge.testing.harness",
        str(spec),
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra_env}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{nproc}-rank group failed:\n{proc.stderr[-3000:]}")
    return torch.load(out, weights_only=False)


def bench(*, steps: int, threads: int, only: list[str]) -> list[Row]:
    """Rows of every layout (or of those named in ``only``, after the baseline)."""
    base = BENCH + [f"train.steps={steps}"]
    tokens = tiny_plan(base).tokens_per_step
    runs = [(LAYOUTS, {}), (POST_BACKWARD, {})]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for groups, extra_env in runs:
            for nproc, layouts in groups.items():
                chosen = {k: v for k, v in layouts.items() if not only or nproc == 1 or k.removesuffix(" post-backward") in only}
                if not chosen:
                    continue
                results = run_group(nproc=nproc, layouts=chosen, base=base, threads=threads, tmp=Path(tmp), extra_env=extra_env)
                rows += [(name, nproc, tokens_per_s(r["step_times"], tokens=tokens), list(r["threads"])) for name, r in results.items()]
    return rows


def render(rows: list[Row]) -> str:
    single = rows[0][2]
    lines = [f"{'layout':<22} {'ranks':>5} {'threads/rank':>12} {'tokens/s':>10} {'vs single':>10}"]
    for name, ranks, tps, threads in rows:
        per_rank = ",".join(str(t) for t in sorted(set(threads)))
        lines.append(f"{name:<22} {ranks:>5} {per_rank:>12} {tps:>10.0f} {tps / single:>9.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per layout (the first is not timed)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every rank, single process included")
    parser.add_argument(
        "--only", nargs="*", default=[], help="layouts to run (e.g. dp2 'dp2 tp2'); the single-process baseline always runs"
    )
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; every layout in its own torchrun group, {args.threads} thread(s) per rank")
    print(render(bench(steps=args.steps, threads=args.threads, only=args.only)))


if __name__ == "__main__":
    main()
