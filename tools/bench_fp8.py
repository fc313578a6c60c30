"""FP8 against bf16 on one GPU: llmforge tokens/s, loss after the same steps, peak memory.

Each row trains the same plan (same initial weights, same batches) in this process
on ``cuda:0`` for ``--steps`` steps: bf16 (autocast), then fp8 with each torchao
recipe asked for. tokens/s is the median over the steps after ``--warmup`` (compile
happens in the first ones); the ratio column is fp8 over the bf16 row, measured
side by side in this run. The estimate's tokens/s for the same plan is printed next to
each row. Needs a GPU with FP8 tensor cores (H100, H200, B200) and torchao.

    python tools/bench_fp8.py                                   # gpt-1b, micro batch 4, compiled
    python tools/bench_fp8.py --recipes tensorwise rowwise -- recipe=gpt-125m train.micro_batch_size=8
    python tools/bench_fp8.py --eager --steps 30 -- model.num_layers=8 model.hidden_size=4096 model.num_heads=32 model.ffn_hidden_size=16384

``precision_rows`` is the part another GPU benchmark can call for its fp8 rows.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch

BASE = [
    "recipe=gpt-1b",
    "parallel=single",
    "cluster=h100-node",
    "cluster.devices_per_node=1",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "logging=quiet",
    "logging.wandb.mode=disabled",
    "checkpoint.save_final=false",
]


def train_row(overrides: Sequence[str], *, steps: int, warmup: int, prepared=None) -> dict[str, float]:
    """Train one plan on cuda:0 in this process; its tokens/s, last loss, peak memory and estimate."""
    from llmforge.config.compose import compose
    from llmforge.estimate.core import estimate_plan
    from llmforge.plan import RunPlan
    from llmforge.train.build import build_components
    from llmforge.train.callbacks import Recorder
    from llmforge.train.components import RankInfo
    from llmforge.train.loop import train_loop
    from llmforge.train.run import make_sampler, prepare_data

    plan = RunPlan.build(compose([*overrides, f"train.steps={steps}"]))
    if prepared is None:
        from rich.console import Console

        prepared = prepare_data(plan, console=Console(stderr=True))
    torch.manual_seed(plan.config.train.seed)
    torch.cuda.reset_peak_memory_stats()
    c = build_components(plan, rank=RankInfo(device=torch.device("cuda", 0)), sampler=make_sampler(plan, prepared))
    recorder = Recorder()
    train_loop(
        c,
        start_step=0,
        total_steps=steps,
        grad_clip=plan.config.optim.grad_clip,
        log_interval=1,
        checkpoint_interval=0,
        callbacks=[recorder],
    )
    torch.cuda.synchronize()
    later = [r["tokens_per_s"] for r in recorder.records[warmup:]] or [recorder.records[-1]["tokens_per_s"]]
    return {
        "tokens_per_s": statistics.median(later),
        "loss": recorder.records[-1]["loss"],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "estimate_tokens_per_s": estimate_plan(plan).tokens_per_s,
    }


def precision_rows(
    overrides: Sequence[str], *, steps: int = 40, warmup: int = 10, recipes: Sequence[str] = ("tensorwise", "rowwise"), compile: bool = True
) -> dict[str, dict[str, float]]:
    """{"bf16": row, "fp8 tensorwise": row, ...} for the plan ``overrides`` (each row: tokens_per_s,
    loss after ``steps``, peak_gib, estimate_tokens_per_s; fp8 rows also ratio = tokens/s over bf16)."""
    common = [*overrides, f"train.compile={'true' if compile else 'false'}"]
    rows = {"bf16": train_row([*common, "precision=bf16"], steps=steps, warmup=warmup)}
    for recipe in recipes:
        row = train_row([*common, "precision=fp8", f"precision.fp8_recipe={recipe}"], steps=steps, warmup=warmup)
        row["ratio"] = row["tokens_per_s"] / rows["bf16"]["tokens_per_s"]
        rows[f"fp8 {recipe}"] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median (compile, allocator)")
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"], choices=["tensorwise", "rowwise"])
    parser.add_argument("--eager", action="store_true", help="train.compile=false (fp8 is meant to run compiled)")
    parser.add_argument("overrides", nargs="*", help="plan overrides after the defaults (gpt-1b, micro batch 4, one H100)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8 needs a CUDA GPU with FP8 tensor cores")
    rows = precision_rows([*BASE, *args.overrides], steps=args.steps, warmup=args.warmup, recipes=args.recipes, compile=not args.eager)
    print(
        f"{torch.cuda.get_device_name()}, {args.steps} steps, median tokens/s after step {args.warmup}, "
        f"{'eager' if args.eager else 'compiled'}; overrides: {' '.join(args.overrides) or '(defaults)'}"
    )
    print(f"{'precision':16s} {'tokens/s':>10s} {'vs bf16':>8s} {'loss@end':>9s} {'peak GiB':>9s} {'estimate tok/s':>15s}")
    for name, row in rows.items():
        ratio = f"{row.get('ratio', 1.0):.3f}x"
        print(
            f"{name:16s} {row['tokens_per_s']:10,.0f} {ratio:>8s} {row['loss']:9.4f} {row['peak_gib']:9.2f} "
            f"{row['estimate_tokens_per_s']:15,.0f}"
        )


if __name__ == "__main__":
    main()
