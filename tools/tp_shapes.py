"""The tensor-parallel estimate against real steps, over GPTs of several shapes, on two CPU ranks.

Each shape is the tiny recipe with model overrides. Both ranks run its tensor-parallel training
step (``llmforge.calibrate.tp_step.stepper``: the microbatches, the gradient clip, AdamW, as a CPU
rank of ``llmforge pretrain`` runs it) and rank 0 prints the median step against the estimate of
the same plan on this machine's calibrated profile, with the estimate's collectives and waits.
Run it on a quiet machine after ``llmforge calibrate cluster.devices_per_node=2``:

    python tools/tp_shapes.py [--steps 8] [--warmup 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

NARROW = ["model.hidden_size=64", "model.ffn_hidden_size=256", "model.vocab_size=1024", "model.seq_len=64"]
SHAPES = {
    "2x64, vocab 1024, seq 64": ["model.num_layers=2", *NARROW],
    "4x64, vocab 1024, seq 64": ["model.num_layers=4", *NARROW],
    "2x128 (tiny, 2 blocks)": ["model.num_layers=2"],
    "4x128 (tiny)": [],
    "2x128, vocab 1024, seq 256": ["model.num_layers=2", "model.vocab_size=1024", "model.seq_len=256"],
    "2x256, 2 microbatches": ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024", "train.global_batch_size=8"],
    "2x256": ["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024"],
}
BASE = ["recipe=tiny", "logging=quiet", "parallel=tp2", "cluster.devices_per_node=2"]


def _measure(overrides: list[str], *, steps: int, warmup: int) -> float:
    import torch.distributed as dist

    from llmforge.calibrate.tp_step import median_step_seconds, stepper
    from llmforge.config.compose import compose

    config = compose([*BASE, *overrides])
    micro = config.train.micro_batch_size
    step = stepper(config.model, micro_batch=micro, microbatches=config.train.global_batch_size // micro, group=dist.group.WORLD)
    return median_step_seconds(step, group=None, timed=steps, most_warmup=warmup)


def _estimate(overrides: list[str]):
    from llmforge.config.compose import compose
    from llmforge.estimate.core import estimate_plan
    from llmforge.plan import RunPlan

    return estimate_plan(RunPlan.build(compose([*BASE, *overrides])))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for name, overrides in SHAPES.items():
        measured = _measure(overrides, steps=args.steps, warmup=args.warmup)
        if dist.get_rank() == 0:
            est = _estimate(overrides)
            waits, comm = est.parts["collective_waits"], est.comm.seconds_of("tp")
            rows.append(f"{name:28s} {measured:8.3f} {est.step_s:8.3f} {measured / est.step_s:6.2f}x {comm:8.3f} {waits:8.3f}")
            print(rows[-1], flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=30, help="at most this many steps before timing (fewer once steps settle)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    print(f"{'shape':28s} {'measured':>8s} {'estimate':>8s} {'ratio':>7s} {'tp comm':>8s} {'waits':>8s}  (seconds a step)", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--rank"]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
