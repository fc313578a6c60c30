"""What one step of ``llmforge pretrain`` does next to the plain GPT's (tools/plain_gpt.py), by counts.

Load-independent evidence for tools/bench_independent.py: each side runs in its own process
as that benchmark starts it (the CLI for llmforge, the plain script for the other), and the
end of each optimizer step (its ``zero_grad``) marks the step. Three windows of ``--steps``
steps follow a warm-up of ``--warmup`` steps:

0. the process's CPU time (and its children's) from its start to the end of step 1;
1. plain: process CPU time (user + system), minor and major page faults, context switches;
2. under ``torch.profiler``: aten ops by name (count and self CPU time);
3. under ``sys.setprofile``: Python-level calls (functions, and C functions called from Python).

Counts do not depend on the machine's load; CPU time depends on it less than the wall clock
(on a shared machine both still vary with cache and memory-bandwidth contention).

    python tools/bench_counts.py [--warmup 5] [--steps 5] [--top 25] [overrides...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


class StepWindows:
    """Called at every step's end (``zero_grad``): opens and closes the three windows."""

    def __init__(self, *, warmup: int, steps: int, out: Path) -> None:
        self.bounds = [warmup + i * steps for i in range(4)]
        self.steps, self.out, self.calls = steps, out, 0
        self.result: dict = {"threads": {}}
        self._mark: tuple = ()
        self._profiler = None
        self._python: collections.Counter = collections.Counter()

    def __call__(self) -> None:
        self.calls += 1
        b = self.bounds
        if self.calls == 1:
            t = os.times()
            self.result["first_step"] = {"cpu_s": t.user + t.system, "children_cpu_s": t.children_user + t.children_system}
        if self.calls == b[0]:
            self._mark = (time.process_time(), resource.getrusage(resource.RUSAGE_SELF))
        elif self.calls == b[1]:
            self._close_usage()
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU])
            self._profiler.start()
        elif self.calls == b[2]:
            self._profiler.stop()
            self.result["ops"] = {e.key: [e.count / self.steps, e.self_cpu_time_total / self.steps] for e in self._profiler.key_averages()}
            sys.setprofile(self._count)
        elif self.calls == b[3]:
            sys.setprofile(None)
            self.result["python_calls"] = {k: v / self.steps for k, v in self._python.most_common(400)}
            self.result["python_calls_total"] = sum(self._python.values()) / self.steps
            self.out.write_text(json.dumps(self.result))

    def _close_usage(self) -> None:
        import torch

        cpu0, u0 = self._mark
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        n = self.steps
        self.result["usage"] = {
            "cpu_s": (time.process_time() - cpu0) / n,
            "user_s": (u1.ru_utime - u0.ru_utime) / n,
            "sys_s": (u1.ru_stime - u0.ru_stime) / n,
            "minor_faults": (u1.ru_minflt - u0.ru_minflt) / n,
            "major_faults": (u1.ru_majflt - u0.ru_majflt) / n,
            "voluntary_switches": (u1.ru_nvcsw - u0.ru_nvcsw) / n,
        }
        self.result["threads"] = {
            "torch": torch.get_num_threads(),
            "interop": torch.get_num_interop_threads(),
            "os": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        }

    def _count(self, frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            self._python[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        elif event == "c_call":
            self._python[f"C:{getattr(arg, '__qualname__', arg)}"] += 1


def _instrument(windows: StepWindows) -> None:
    import torch

    original = torch.optim.Optimizer.zero_grad

    def zero_grad(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        windows()
        return out

    torch.optim.Optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def side_main(args: argparse.Namespace) -> None:
    """In the child process: instrument, then run the side as the benchmark does."""
    windows = StepWindows(warmup=args.warmup, steps=args.steps, out=Path(args.out))
    _instrument(windows)
    total = args.warmup + 3 * args.steps + 1
    if args.side == "llmforge":
        from llmforge.cli import main

        sys.argv = ["llmforge", "pretrain", *args.overrides, f"train.steps={total}", f"run.dir={Path(args.out).parent / 'run'}"]
        main()
    else:
        import plain_gpt

        sys.argv = ["plain_gpt.py", *args.overrides, f"--steps={total}"]
        plain_gpt.main()


def run_side(side: str, *, args: argparse.Namespace, overrides: list[str], folder: Path) -> dict:
    out = folder / f"{side}-counts" / "counts.json"
    out.parent.mkdir(parents=True)
    cmd = [sys.executable, __file__, f"--side={side}", f"--out={out}", f"--warmup={args.warmup}", f"--steps={args.steps}", "--", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode or not out.exists():
        sys.exit(f"{side} failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def report(got: dict, *, top: int) -> None:
    a, b = got["llmforge"], got["plain"]
    print(f"{'per step':32s} {'llmforge':>12s} {'plain':>12s}")
    for key in ("cpu_s", "user_s", "sys_s", "minor_faults", "major_faults", "voluntary_switches"):
        print(f"{key:32s} {a['usage'][key]:12.4g} {b['usage'][key]:12.4g}")
    for key in ("cpu_s", "children_cpu_s"):
        print(f"{'start-up + step 1 ' + key:32s} {a['first_step'][key]:12.3f} {b['first_step'][key]:12.3f}")
    for key in ("torch", "interop", "os"):
        print(f"{'threads ' + key:32s} {a['threads'][key]!s:>12s} {b['threads'][key]!s:>12s}")
    ops_a, ops_b = a["ops"], b["ops"]
    for name, ops in (
        ("aten ops", lambda o: o),
        ("aten ops (aten:: only)", lambda o: {k: v for k, v in o.items() if k.startswith("aten::")}),
    ):
        ca, cb = (sum(v[0] for v in ops(o).values()) for o in (ops_a, ops_b))
        ta, tb = (sum(v[1] for v in ops(o).values()) / 1e3 for o in (ops_a, ops_b))
        print(f"{name + ' (count)':32s} {ca:12.0f} {cb:12.0f}")
        print(f"{name + ' (self CPU ms)':32s} {ta:12.1f} {tb:12.1f}")
    print(f"{'python calls':32s} {a['python_calls_total']:12.0f} {b['python_calls_total']:12.0f}")
    print("\naten ops whose counts differ most (llmforge, plain), per step: count, self CPU ms")
    keys = set(ops_a) | set(ops_b)
    diff = sorted(keys, key=lambda k: -abs(ops_a.get(k, [0, 0])[0] - ops_b.get(k, [0, 0])[0]))
    for k in diff[:top]:
        (na, ta), (nb, tb) = ops_a.get(k, [0, 0]), ops_b.get(k, [0, 0])
        if na != nb:
            print(f"  {k[:60]:60s} {na:7.1f} {nb:7.1f}  {ta / 1e3:8.2f} {tb / 1e3:8.2f}")
    print("\nPython calls llmforge makes most, per step (plain's count beside)")
    for k, v in list(a["python_calls"].items())[:top]:
        print(f"  {k[:60]:60s} {v:8.1f} {b['python_calls'].get(k, 0):8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("llmforge", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps in each of the three windows")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both sides")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("overrides", nargs="*", help="llmforge overrides (default recipe=tiny)")
    args = parser.parse_args()
    if args.side:
        return side_main(args)
    from bench_independent import QUIET, commands, prepared_tokens

    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    overrides = args.overrides or ["recipe=tiny"]
    plan = RunPlan.build(compose([*overrides, *QUIET]))
    with tempfile.TemporaryDirectory(prefix="bench_counts_") as tmp:
        sides = commands(overrides, prepared_tokens(plan), plan, Path(tmp))
        plain_cmd, _ = sides["plain"](0)
        plain_args = [a for a in plain_cmd[2:] if not a.startswith(("--steps=", "--log="))] + [f"--log={Path(tmp) / 'plain.log'}"]
        got = {
            "llmforge": run_side("llmforge", args=args, overrides=[*overrides, *QUIET], folder=Path(tmp)),
            "plain": run_side("plain", args=args, overrides=plain_args, folder=Path(tmp)),
        }
    print(f"{overrides}: {args.steps} steps per window after {args.warmup} warm-up steps, {args.threads} thread(s)")
    report(got, top=args.top)


if __name__ == "__main__":
    main()
