"""Memory of a 16-bit run with the residual stream in the compute dtype (the default) and in fp32
(``precision.fp32_residual=true``), one process.

    python tools/bench_residual.py [--recipe gpt-125m] [--seq 512] [--micro-batch 4] [--steps 3]
                                   [--recompute none] [--precision bf16] [--device cpu]

For each setting: the bytes one microbatch saves for backward (rank 0 of the backend's own
components on the CPU, ``llmforge.train.footprint``; exact; not with ``--device cuda``) and the peak memory of a fresh process
training ``--steps`` steps on synthetic tokens (``llmforge.testing.harness``): its peak
resident memory on a CPU, the CUDA allocator's peak on a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def overrides(args: argparse.Namespace, *, fp32_residual: bool) -> list:
    return [
        f"recipe={args.recipe}",
        "parallel=single",
        "cluster=cpu",
        f"precision={args.precision}",
        f"precision.fp32_residual={str(fp32_residual).lower()}",
        f"model.seq_len={args.seq}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch}",
        f"train.steps={args.steps}",
        f"parallel.recompute={args.recompute}",
    ]


def child(args: argparse.Namespace, fp32_residual: bool) -> None:
    """One training run in this process; prints its peak memory (bytes) as JSON."""
    import resource

    import torch

    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan
    from llmforge.testing.harness import train_layout

    plan = RunPlan.build(compose(overrides(args, fp32_residual=fp32_residual)))
    result = train_layout(plan, device=torch.device(args.device))
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak, "losses": result.losses}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gpt-125m")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--saved-only", action="store_true", help="measure the saved bytes only, no training runs")
    parser.add_argument("--child", choices=["true", "false"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args, args.child == "true")

    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan
    from llmforge.train.footprint import measure_step

    print(
        f"recipe={args.recipe}, seq {args.seq}, micro-batch {args.micro_batch}, {args.precision}, recompute={args.recompute}, "
        f"{args.steps} steps on {args.device} (MiB = 2**20 bytes)"
    )
    peak_name = "peak allocated" if args.device == "cuda" else "peak RSS"
    print(f"{'residual stream':>16} | {'saved / microbatch':>18} | {peak_name:>14} | losses")
    for fp32_residual in (True, False):
        saved = measure_step(RunPlan.build(compose(overrides(args, fp32_residual=fp32_residual))))[1] if args.device == "cpu" else None
        run = {"peak": None, "losses": []}
        if not args.saved_only:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(fp32_residual).lower()]
            run = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        name = "fp32" if fp32_residual else args.precision
        losses = " ".join(f"{x:.4f}" for x in run["losses"])
        cell = f"{saved / 2**20:14.1f} MiB" if saved is not None else f"{'-':>18}"
        peak = f"{run['peak'] / 2**20:10.1f} MiB" if run["peak"] is not None else f"{'-':>14}"
        print(f"{name:>16} | {cell} | {peak} | {losses}")


if __name__ == "__main__":
    main()
