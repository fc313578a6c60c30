"""Expert load balance of moe-tiny under each ``model.moe.balance`` setting, over several seeds.

    python tools/moe_balance.py                       # 3 seeds x 100 steps x aux/bias/none
    python tools/moe_balance.py --steps 50 --seeds 2 train.global_batch_size=8

Every (balance, seed) run trains the moe-tiny recipe in this process on the built-in
corpus (extra arguments are overrides for every run) and logs each step. The table shows,
mean ± std over the seeds, the load coefficient of variation (``moe/load_cv``: std / mean of
the tokens each expert received, averaged over the MoE layers; 0 is perfectly even) over the
last half of the steps and at the last step, the worst layer's max/mean load at the last step,
and the last loss. The runs differ only in the balancing: ``aux`` adds the Switch loss
(``model.moe.aux_loss_coef``), ``bias`` moves DeepSeek-V3's per-expert routing bias
(``model.moe.bias_update_rate``), ``none`` does neither.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


def one_run(*, balance: str, seed: int, steps: int, extra: list[str], root: Path) -> list[dict]:
    from llmforge.config.compose import compose
    from llmforge.observe.metrics import read_metrics
    from llmforge.plan import RunPlan
    from llmforge.train.components import RankInfo
    from llmforge.train.run import run

    run_dir = root / f"{balance}-{seed}"
    overrides = [
        "recipe=moe-tiny",
        f"model.moe.balance={balance}",
        f"train.seed={seed}",
        f"train.steps={steps}",
        "train.log_interval=1",
        f"run.dir={run_dir}",
        "logging.console=false",
        "logging.wandb.mode=disabled",
        "checkpoint.save_final=false",
        *extra,
    ]
    run(RunPlan.build(compose(overrides)), rank=RankInfo())
    return read_metrics(run_dir / "metrics.jsonl")


def summary(records: list[dict]) -> dict[str, float]:
    late = records[len(records) // 2 :]
    return {
        "cv_late": statistics.fmean(r["moe/load_cv"] for r in late),
        "cv_last": records[-1]["moe/load_cv"],
        "max_imb_last": records[-1]["moe/max_load_imbalance"],
        "loss_last": records[-1]["loss"],
    }


def table(results: dict[str, list[dict[str, float]]], *, steps: int) -> str:
    def cell(values: list[float]) -> str:
        return f"{statistics.fmean(values):.3f} ± {statistics.pstdev(values):.3f}"

    cols = (
        ("cv_late", f"load CV, steps {steps // 2 + 1}-{steps}"),
        ("cv_last", f"load CV, step {steps}"),
        ("max_imb_last", f"worst layer max/mean, step {steps}"),
        ("loss_last", f"loss, step {steps}"),
    )
    lines = ["| model.moe.balance | " + " | ".join(name for _, name in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for balance, runs in results.items():
        lines.append(f"| {balance} | " + " | ".join(cell([r[key] for r in runs]) for key, _ in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--balance", nargs="+", default=["aux", "bias", "none"], choices=["aux", "bias", "none"])
    parser.add_argument("overrides", nargs="*", help="extra overrides for every run, e.g. train.global_batch_size=8")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for balance in args.balance:
            for seed in range(args.seeds):
                records = one_run(balance=balance, seed=seed, steps=args.steps, extra=args.overrides, root=Path(tmp))
                results.setdefault(balance, []).append(summary(records))
                print(f"{balance} seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in results[balance][-1].items()), flush=True)
    print(
        f"\nmoe-tiny, {args.seeds} seeds x {args.steps} steps{' ' + ' '.join(args.overrides) if args.overrides else ''} (mean ± std over "
        "seeds)\n"
    )
    print(table(results, steps=args.steps))


if __name__ == "__main__":
    main()
