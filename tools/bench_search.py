"""Speed and results of `llmforge estimate --search` on a few setups.

    python tools/bench_search.py [--top 3]

For each setup: layouts evaluated, how many fit, seconds, layouts per second,
and the top layouts with tokens/s, MFU and memory.
"""

from __future__ import annotations

import argparse

SETUPS = {
    "gpt-7b on 1 x 8 H100": ["recipe=gpt-7b", "cluster.nodes=1"],
    "gpt-7b on 4 x 8 H100": ["recipe=gpt-7b"],
    "llama-70b on 8 x 8 H100": ["recipe=llama-8b", "model=llama-70b", "cluster.nodes=8"],
    "mixtral-8x7b on 8 x 8 H100": ["recipe=mixtral-8x7b"],
    "llama-8b on 2 x 8 A100-40GB": ["recipe=llama-8b", "cluster.nodes=2", "cluster.accelerator=a100-40gb"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    from llmforge.config.compose import compose
    from llmforge.estimate.search import search_plan, why
    from llmforge.plan import RunPlan

    for name, overrides in SETUPS.items():
        plan = RunPlan.build(compose(overrides))
        result = search_plan(plan, top=args.top)
        print(f"{name}: {result.evaluated} layouts, {result.fitting} fit, {result.seconds:.3f} s ({result.rate:,.0f} layouts/s)")
        for i, est in enumerate(result.ranked, 1):
            print(
                f"  #{i} {est.tokens_per_s:>12,.0f} tok/s  MFU {est.mfu:5.1%}  {est.worst.total / 2**30:6.1f} GiB  {est.layout.overrides()}"
            )
        if len(result.ranked) > 1:
            print(f"  {why(result.ranked[0], result.ranked[1])}")
        for line in result.suggestions:
            print(f"  {line}")


if __name__ == "__main__":
    main()
