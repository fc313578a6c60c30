"""``llmforge pretrain`` against an independent plain GPT (tools/plain_gpt.py), each in its own process.

The plain side is what a user writes without llmforge: its own nanoGPT-style model of the
recipe's shape, the same token file, batch, micro batch, learning rate and clip, torch's
default AdamW. The llmforge side is the CLI, ``llmforge pretrain`` on the recipe (with
``logging=quiet``, no checkpoints: the plain loop writes neither a progress bar nor a
checkpoint). Both run with the same ``OMP_NUM_THREADS``.

Steady-state step time, without start-up and warm-up: each side runs twice, ``--short`` and
``--long`` steps, and its step time is the difference of the two runs' times over the
difference of their steps. Python and torch imports, data and model set-up, the first
steps' warm-up (allocator, kernels' first calls) and the end of the run are in both runs
and cancel. Times are the child processes' CPU seconds (``--clock cpu``, the default: on a
machine others share, waiting for a core is left out; with one thread no spin-waiting is
counted) or wall seconds (``--clock wall``); both are printed.

Rounds alternate which side goes first, so drifting load hits both alike; the figure is the
median of the per-round ratios plain / llmforge (1.0 = parity, above 1 llmforge is faster;
target >= 0.97), with their spread.

    python tools/bench_independent.py [--rounds 5] [--short 10] [--long 30] [--threads 1] [--clock cpu|wall] [overrides...]
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["logging=quiet", "checkpoint.interval=0", "checkpoint.save_final=false"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: List[str], *, env: Dict[str, str]) -> Tuple[float, float]:
    """(CPU seconds, wall seconds) of ``cmd`` and everything it waited for."""
    cpu, wall = _children_cpu(), time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return _children_cpu() - cpu, time.perf_counter() - wall


def commands(overrides: List[str], tokens: Tuple[str, str], plan, run_dir: Path):
    """{side: steps -> command}."""
    m, t, o = plan.config.model, plan.config.train, plan.config.optim

    runs = itertools.count()

    def ours(steps: int) -> List[str]:  # a fresh run directory each time
        return [sys.executable, "-m", "llmforge", "pretrain", *overrides, *QUIET, f"train.steps={steps}", f"run.dir={run_dir / str(next(runs))}"]

    def plain(steps: int) -> List[str]:
        shape = {"layers": m.num_layers, "width": m.hidden_size, "heads": m.num_heads, "ffn": m.ffn_hidden_size, "vocab": m.vocab_size,
                 "seq": m.seq_len, "micro-batch": t.micro_batch_size, "global-batch": t.global_batch_size, "warmup": o.warmup_steps,
                 "seed": t.seed, "lr": t.lr, "weight-decay": o.weight_decay, "grad-clip": o.grad_clip}
        args = [f"--{k}={v}" for k, v in shape.items()]
        return [sys.executable, str(ROOT / "tools" / "plain_gpt.py"), f"--tokens={tokens[0]}", f"--dtype={tokens[1]}", f"--steps={steps}", *args]

    return {"llmforge": ours, "plain": plain}


def per_step(run, *, short: int, long: int, env: Dict[str, str]) -> Tuple[float, float]:
    """(CPU, wall) seconds of one steady-state step: the long run less the short one."""
    cpu_s, wall_s = timed(run(short), env=env)
    cpu_l, wall_l = timed(run(long), env=env)
    return (cpu_l - cpu_s) / (long - short), (wall_l - wall_s) / (long - short)


def prepared_tokens(plan) -> Tuple[str, str]:
    """The recipe's first token shard and its dtype (preparing the data once if need be)."""
    from rich.console import Console

    from llmforge.train.run import prepare_data

    prepared = prepare_data(plan, console=Console(stderr=True))
    info = prepared.streams[0]
    return str(Path(info.folder) / info.shards[0][0]), prepared.dtype


def summary(name: str, ratios: List[float]) -> str:
    q = sorted(ratios)
    return (f"{name}: median of paired ratios plain/llmforge {statistics.median(q):.3f} over {len(q)} rounds "
            f"(spread {q[0]:.3f}-{q[-1]:.3f}; target >= 0.97)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--short", type=int, default=10, help="steps of the run whose time is subtracted (start-up and warm-up)")
    parser.add_argument("--long", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both sides")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="which clock the headline ratio uses")
    parser.add_argument("overrides", nargs="*", help="llmforge overrides (default recipe=tiny)")
    args = parser.parse_args()
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    overrides = args.overrides or ["recipe=tiny"]
    plan = RunPlan.build(compose([*overrides, *QUIET]))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    with tempfile.TemporaryDirectory(prefix="bench_independent_") as tmp:
        sides = commands(overrides, prepared_tokens(plan), plan, Path(tmp))
        timed(sides["llmforge"](1), env=env)  # a first run here calibrates the CPU profile: not in any round
        ratios: Dict[str, List[float]] = {"cpu": [], "wall": []}
        print(f"{overrides}: {plan.tokens_per_step} tokens/step, steps {args.short + 1}-{args.long} timed, {args.threads} thread(s)")
        for r in range(args.rounds):
            order = ("llmforge", "plain") if r % 2 == 0 else ("plain", "llmforge")
            got = {side: per_step(sides[side], short=args.short, long=args.long, env=env) for side in order}
            for i, clock in enumerate(("cpu", "wall")):
                ratios[clock].append(got["plain"][i] / got["llmforge"][i])
            print(f"round {r + 1} ({order[0]} first): step cpu s llmforge {got['llmforge'][0]:.4f} plain {got['plain'][0]:.4f} "
                  f"ratio {ratios['cpu'][-1]:.3f} | wall s llmforge {got['llmforge'][1]:.4f} plain {got['plain'][1]:.4f} ratio {ratios['wall'][-1]:.3f}", flush=True)
    for clock in (args.clock, "wall" if args.clock == "cpu" else "cpu"):
        print(summary(f"{clock:4} clock", ratios[clock]))


if __name__ == "__main__":
    main()
