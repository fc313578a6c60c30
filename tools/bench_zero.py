"""Model-state bytes per rank of each ZeRO stage, measured, estimated and by the ZeRO paper.

    python tools/bench_zero.py [--recipe gpt-125m] [--dp 8] [--precision bf16] [--reduce fp32]

Measured: rank 0 of a ``dp``-rank data-parallel run of the recipe's model, built by
llmforge's backend in this process on torch's fake process group (shapes, dtypes
and sharding are real, collectives do nothing), after the first of two microbatches'
backward in the step after an optimizer step: weights (shards and gathered compute
copies), gradients and AdamW states (``llmforge.train.footprint``). The sequence
is cut to 128 tokens to keep the run short (model states do not depend on it).
Estimated: ``llmforge estimate``'s model states for the same plan. Paper:
Rajbhandari et al. 2020, mixed-precision Adam with K = 12, Ψ parameters, N_d ranks:
(2 + 2 + K)Ψ, 2Ψ + 2Ψ + KΨ/N_d, 2Ψ + (2 + K)Ψ/N_d, (2 + 2 + K)Ψ/N_d.
"""

from __future__ import annotations

import argparse

PAPER = {
    0: lambda n, d: 16 * n,
    1: lambda n, d: 4 * n + 12 * n / d,
    2: lambda n, d: 2 * n + 14 * n / d,
    3: lambda n, d: 16 * n / d,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gpt-125m")
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--reduce", default="fp32", choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args()

    from llmforge.config.compose import compose
    from llmforge.estimate.inventory import inventory
    from llmforge.estimate.memory import model_states
    from llmforge.estimate.shape import from_plan
    from llmforge.plan import RunPlan
    from llmforge.train.footprint import measure_step

    print(
        f"recipe={args.recipe}, dp={args.dp}, param_dtype={args.precision}, reduce_dtype={args.reduce}; "
        "model states of rank 0 (MB = 1e6 bytes), bytes per parameter in brackets"
    )
    header = f"{'zero':>4} | {'measured':>16} | {'estimated':>16} | {'ZeRO paper':>16} | weights / grads / AdamW measured (MB)"
    print(header)
    print("-" * len(header))
    for zero in range(4):
        overrides = [
            f"recipe={args.recipe}",
            "parallel=single",
            f"parallel.dp={args.dp}",
            "cluster=cpu",
            f"cluster.devices_per_node={args.dp}",
            f"parallel.zero={zero}",
            f"precision.param_dtype={args.precision}",
            f"precision.reduce_dtype={args.reduce}",
            "model.seq_len=128",
            "train.micro_batch_size=1",
            f"train.global_batch_size={2 * args.dp}",
        ]
        plan = RunPlan.build(compose(overrides))
        (weights, grads, states), _ = measure_step(plan)
        shape, layout, job = from_plan(plan)
        n, w, g, o = model_states(inventory(shape, layout), 0, job)
        measured, estimated, paper = weights + grads + states, w + g + o, PAPER[zero](n, args.dp)
        cells = [f"{v / 1e6:8.1f} ({v / n:5.2f})" for v in (measured, estimated, paper)]
        print(f"{zero:>4} | " + " | ".join(cells) + f" | {weights / 1e6:.1f} / {grads / 1e6:.1f} / {states / 1e6:.1f}")
    print(f"parameters: {n:,}")


if __name__ == "__main__":
    main()
