"""What building the model costs a rank: peak host memory of rank 0 of a ZeRO-3 run of a
large model, above the same run of a tiny model, as a fraction of the large model's fp32 weights.

    python tools/bench_build.py [--dp 8] [--layers 20] [--hidden 1024] [--steps 2]

Both runs are ``llmforge pretrain`` on ``cluster=cpu`` (one gloo process per rank) with the
same data, batch and layout; rank 0's peak resident memory (``peak_rss_gib`` in
metrics.jsonl) of the tiny run is what every rank pays anyway (torch, the data, the
process group). A rank that built the whole model before sharding it would peak at about
the whole model or more above it; one that builds on the meta device and allocates its
shards only pays its shards of weights, gradients and AdamW states (16 bytes per
parameter / dp under ZeRO-3), one whole parameter while it is cut, and activations.
The closing line's ``peak memory`` ratio (measured / estimated) is printed for both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 1024**3


def run(*, overrides: list, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "llmforge", "pretrain", *overrides, f"run.dir={run_dir}", "logging.wandb.mode=disabled", "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    closing = next((line for line in (proc.stdout + proc.stderr).splitlines()[::-1] if "peak memory" in line), "")
    return {"peak_gib": max(r.get("peak_rss_gib", 0.0) for r in rows), "closing": closing.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    common = [
        "parallel=fsdp",
        f"parallel.dp={args.dp}",
        "parallel.zero=3",
        "train.micro_batch_size=1",
        f"train.global_batch_size={args.dp}",
        f"train.steps={args.steps}",
        "checkpoint.interval=1000000",
        "model.seq_len=128",
        "train.eval_interval=0",
        "data.val_fraction=0",
    ]
    big = [
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        f"model.num_heads={args.hidden // 64}",
        f"model.ffn_hidden_size={4 * args.hidden}",
    ]
    from llmforge.config.compose import compose
    from llmforge.estimate.params import total_params
    from llmforge.estimate.shape import from_plan
    from llmforge.plan import RunPlan

    shape, _, _ = from_plan(RunPlan.build(compose(common + big)))
    weights = total_params(shape) * 4
    with tempfile.TemporaryDirectory() as tmp:
        tiny = run(overrides=common, run_dir=Path(tmp) / "tiny")
        large = run(overrides=common + big, run_dir=Path(tmp) / "large")
    above = large["peak_gib"] - tiny["peak_gib"]
    print(f"model: {total_params(shape) / 1e6:.0f}M parameters, {weights / GIB:.2f} GiB in fp32; dp{args.dp} ZeRO-3, rank 0")
    print(
        f"peak RSS: tiny {tiny['peak_gib']:.2f} GiB, large {large['peak_gib']:.2f} GiB, above the tiny run {above:.2f} GiB "
        f"= {above * GIB / weights:.2f}x the whole model's fp32 weights"
    )
    print(f"closing line, tiny:  {tiny['closing']}")
    print(f"closing line, large: {large['closing']}")


if __name__ == "__main__":
    main()
