"""Wall time of `llmforge estimate recipe=gpt-7b parallel=tp4pp2`, end to end and by part.

    python tools/bench_estimate.py [--runs 5] [overrides ...]

Prints the median wall time of the whole command (a fresh interpreter each run,
as a user sees it), then, in one process: importing the CLI, composing and
validating the plan, and the estimate itself; and whether torch was imported.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

DEFAULT = ["recipe=gpt-7b", "parallel=tp4pp2"]


def cli_wall(overrides: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llmforge", "estimate", *overrides], check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parts(overrides: list[str]) -> dict:
    code = f"""
import sys, time, json
t0 = time.perf_counter()
import llmforge.cli
t1 = time.perf_counter()
from llmforge.config.compose import compose
from llmforge.plan import RunPlan
plan = RunPlan.build(compose({overrides!r}))
t2 = time.perf_counter()
from llmforge.estimate.report import as_dict
from llmforge.estimate.core import estimate_plan
as_dict(estimate_plan(plan))
t3 = time.perf_counter()
print(json.dumps({{"import_cli_s": t1 - t0, "compose_plan_s": t2 - t1, "estimate_s": t3 - t2, "torch_imported": "torch" in sys.modules}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    import json

    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("overrides", nargs="*", default=DEFAULT)
    args = parser.parse_args()
    wall = cli_wall(args.overrides, args.runs)
    p = parts(args.overrides)
    print(f"llmforge estimate {' '.join(args.overrides)}")
    print(f"  whole command (median of {args.runs}): {wall:.3f} s")
    print(
        f"  import llmforge.cli: {p['import_cli_s']:.3f} s | compose + validate: {p['compose_plan_s']:.3f} s | estimate: "
        f"{p['estimate_s'] * 1e3:.1f} ms"
    )
    print(f"  torch imported: {p['torch_imported']}")


if __name__ == "__main__":
    main()
