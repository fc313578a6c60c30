"""``llmforge pretrain`` against an independent plain GPT (tools/plain_gpt.py), each in its own process.

The plain side is what a user writes without llmforge: its own nanoGPT-style model of the
recipe's shape, the same token file, batch, micro batch, learning rate and clip, torch's
default AdamW. The llmforge side is the CLI, ``llmforge pretrain`` on the recipe (with
``logging=quiet``, no checkpoints: the plain loop writes neither a progress bar nor a
checkpoint). Both run with the same ``OMP_NUM_THREADS``.

Steady-state step time, without start-up and warm-up: each side runs ``--long`` steps in its
own process, and the driver samples that process's CPU time (``/proc/PID/stat``: user and
system, every thread) and the wall clock when the process reports step ``--short`` and step
``--long`` (the plain script's ``--log`` line; llmforge's metrics.jsonl record, written every
``train.log_interval`` steps: pick multiples of it). Python and torch imports, data and model
set-up and the first steps' warm-up (allocator, kernels' first calls) come before the first
sample; the end of the run after the second. Each side is started for ``train.log_interval`` steps
more than ``--long`` and stopped once it reports step ``--long``, so llmforge's validation after
its last step (the plain loop has none) is not in the timed steps. ``--clock cpu`` (the default) reads the ratio on
CPU time: on a machine others share, waiting for a core is left out (with one thread no
spin-waiting is counted either); ``--clock wall`` on the wall clock; both are printed.

Rounds alternate which side goes first, so drifting load hits both alike; the figure is the
median of the per-round ratios plain / llmforge (1.0 = parity, above 1 llmforge is faster;
target >= 0.97), with their spread.

    python tools/bench_independent.py [--rounds 5] [--short 5] [--long 25] [--threads 1] [--clock cpu|wall] [overrides...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["logging=quiet", "checkpoint.interval=0", "checkpoint.save_final=false"]


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _steps_logged(path: Path) -> list[int]:
    """The step numbers a side has reported so far (plain: ``step N:`` lines; llmforge: metrics.jsonl)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("step ") and ":" in line:
            out.append(int(line.split()[1].rstrip(":")))
        elif line.startswith("{") and line.endswith("}"):
            out.append(json.loads(line)["step"])
    return out


def steady(cmd: list[str], *, log: Path, short: int, long: int, env: dict[str, str]) -> tuple[float, float]:
    """(CPU, wall) seconds per step between the end of step ``short`` and of step ``long``: the
    process is sampled (``/proc/PID/stat``, every 5 ms) when it reports each of those steps."""
    marks: dict[int, tuple[float, float]] = {}
    console = Path(tempfile.mkstemp(suffix=".console", dir=log.parent.parent)[1])
    with open(console, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None and long not in marks:
            cpu, wall = _process_cpu(proc.pid), time.perf_counter()
            for step in set(_steps_logged(log)) & {short, long}:
                marks.setdefault(step, (cpu, wall))
            time.sleep(0.005)
        if proc.poll() is None:  # the steps past ``long`` (and llmforge's closing validation) are not timed
            proc.kill()
        proc.wait()
    if long not in marks or short not in marks:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}): {console.read_text()[-3000:]}")
    (c0, w0), (c1, w1) = marks[short], marks[long]
    return (c1 - c0) / (long - short), (w1 - w0) / (long - short)


def commands(overrides: list[str], tokens: tuple[str, str], plan, run_dir: Path):
    """{side: steps -> command}."""
    m, t, o = plan.config.model, plan.config.train, plan.config.optim

    runs = itertools.count()

    def ours(steps: int) -> tuple[list[str], Path]:  # a fresh run directory each time
        folder = run_dir / str(next(runs))
        return [
            sys.executable,
            "-m",
            "llmforge",
            "pretrain",
            *overrides,
            *QUIET,
            f"train.steps={steps}",
            f"run.dir={folder}",
        ], folder / "metrics.jsonl"

    def plain(steps: int) -> list[str]:
        shape = {
            "layers": m.num_layers,
            "width": m.hidden_size,
            "heads": m.num_heads,
            "ffn": m.ffn_hidden_size,
            "vocab": m.vocab_size,
            "seq": m.seq_len,
            "micro-batch": t.micro_batch_size,
            "global-batch": t.global_batch_size,
            "warmup": o.warmup_steps,
            "seed": t.seed,
            "lr": t.lr,
            "weight-decay": o.weight_decay,
            "grad-clip": o.grad_clip,
        }
        args = [f"--{k}={v}" for k, v in shape.items()]
        log = run_dir / "plain" / f"{next(runs)}.log"
        log.parent.mkdir(exist_ok=True)
        cmd = [
            sys.executable,
            str(ROOT / "tools" / "plain_gpt.py"),
            f"--tokens={tokens[0]}",
            f"--dtype={tokens[1]}",
            f"--steps={steps}",
            f"--log={log}",
            *args,
        ]
        return cmd, log

    return {"llmforge": ours, "plain": plain}


def prepared_tokens(plan) -> tuple[str, str]:
    """The recipe's first token shard and its dtype (preparing the data once if need be)."""
    from rich.console import Console

    from llmforge.train.run import prepare_data

    prepared = prepare_data(plan, console=Console(stderr=True))
    info = prepared.streams[0]
    return str(Path(info.folder) / info.shards[0][0]), prepared.dtype


def summary(name: str, ratios: list[float]) -> str:
    q = sorted(ratios)
    return (
        f"{name}: median of paired ratios plain/llmforge {statistics.median(q):.3f} over {len(q)} rounds "
        f"(spread {q[0]:.3f}-{q[-1]:.3f}; target >= 0.97)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--short", type=int, default=5, help="warm-up: timing starts when this step ends (a multiple of train.log_interval)"
    )
    parser.add_argument("--long", type=int, default=25, help="timing ends when this step ends (a multiple of train.log_interval)")
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
        cmd, _ = sides["llmforge"](1)
        subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, check=True
        )  # a first run here calibrates the CPU profile: not in any round
        ratios: dict[str, list[float]] = {"cpu": [], "wall": []}
        print(f"{overrides}: {plan.tokens_per_step} tokens/step, steps {args.short + 1}-{args.long} timed, {args.threads} thread(s)")
        for r in range(args.rounds):
            order = ("llmforge", "plain") if r % 2 == 0 else ("plain", "llmforge")
            got = {}
            for side in order:
                cmd, log = sides[side](args.long + plan.config.train.log_interval)
                got[side] = steady(cmd, log=log, short=args.short, long=args.long, env=env)
            for i, clock in enumerate(("cpu", "wall")):
                ratios[clock].append(got["plain"][i] / got["llmforge"][i])
            print(
                f"round {r + 1} ({order[0]} first): step cpu s llmforge {got['llmforge'][0]:.4f} plain {got['plain'][0]:.4f} "
                f"ratio {ratios['cpu'][-1]:.3f} | wall s llmforge {got['llmforge'][1]:.4f} plain {got['plain'][1]:.4f} "
                f"ratio {ratios['wall'][-1]:.3f}",
                flush=True,
            )
    for clock in (args.clock, "wall" if args.clock == "cpu" else "cpu"):
        print(summary(f"{clock:4} clock", ratios[clock]))


if __name__ == "__main__":
    main()
