"""The GPU truth in one command: one markdown report of what llmforge does on this GPU.

    python tools/gpu_report.py [--out gpu-report.md] [--accelerator h100-80gb] [--steps 30] [--warmup 10]
    python tools/gpu_report.py --cpu-smoke --out /tmp/smoke.md    # the same pipeline on tiny CPU shapes

On a GPU it runs, in one process where it can (a fresh machine costs minutes):

1. ``llmforge calibrate cluster.accelerator=ACC cluster.devices_per_node=1`` into the
   report's folder (the measured profile next to the datasheet one);
2. ``tools/bench_gpu.py``'s loops for gpt-125m (micro batch 8) and gpt-1b (micro batch 4):
   llmforge eager and compiled, bf16 and fp8 (tensorwise, where the profile has FP8),
   recompute none / selective / full, and the plain PyTorch loop per shape and mode;
3. the estimate of each of those plans with the datasheet profile and with the
   calibrated one: tokens/s and peak memory, as measured / estimate;
4. the ``gpu``-marked tests (``python -m pytest -m gpu tests/gpu``);

and writes the report: the table first, then the targets (gpt-125m at or above the
plain loop, gpt-1b compiled at 45% MFU or more, selective recompute within 5% of
none, the calibrated estimate within 15% of tokens/s and 10% of peak memory), the
calibration's table and the tests' summary.

``--cpu-smoke`` runs the same steps on the CPU on gpt-tiny (eager, bf16, recompute
none and full, a few steps, ``calibrate --quick``, no GPU tests): it checks that the
report is assembled, not how fast anything is.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
GIB = 1024**3


@dataclass(frozen=True)
class Suite:
    """What one report measures."""

    shapes: Sequence[tuple]  # (model, micro batch)
    modes: Sequence[str]
    precisions: Sequence[str]
    recomputes: Sequence[str]
    calibrate_args: Sequence[str]
    gpu_tests: bool


GPU = Suite((("gpt-125m", 8), ("gpt-1b", 4)), ("eager", "compiled"), ("bf16", "fp8"), ("none", "selective", "full"), (), True)
SMOKE = Suite((("gpt-tiny", 2),), ("eager",), ("bf16",), ("none", "full"), ("--quick",), False)
#: A short session's subset: the plain-loop comparison, the selective-recompute cost and fp8.
QUICK = Suite((("gpt-125m", 8), ("gpt-1b", 4)), ("eager", "compiled"), ("bf16", "fp8"), ("none", "selective"), ("--quick",), False)


@dataclass
class Row:
    model: str
    micro_batch: int
    mode: str
    precision: str
    recompute: str
    overrides: list[str]
    tokens_per_s: float = 0.0
    peak_bytes: float = 0.0
    plain_tokens_per_s: float | None = None
    mfu: float = 0.0
    before: dict = field(default_factory=dict)  # estimate with the datasheet profile: tokens_per_s, memory
    after: dict = field(default_factory=dict)  # with the calibrated profile

    @property
    def name(self) -> str:
        return f"{self.model} mb{self.micro_batch} {self.mode} {self.precision} {self.recompute}"


def overrides(model: str, mb: int, *, mode: str, precision: str, recompute: str, accelerator: str) -> list[str]:
    out = [
        f"model={model}",
        f"train.micro_batch_size={mb}",
        f"train.global_batch_size={mb}",
        "parallel=single",
        f"cluster.accelerator={accelerator}",
        "cluster.devices_per_node=1",
        "logging.wandb.mode=disabled",
        "logging.console=false",
        f"train.compile={'true' if mode == 'compiled' else 'false'}",
        f"parallel.recompute={recompute}",
    ]
    return out + (["precision=fp8", "precision.fp8_recipe=tensorwise"] if precision == "fp8" else [f"precision={precision}"])


def plan_of(args: Sequence[str], *, accelerator: str | None = None):
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    return RunPlan.build(compose([*args, *([f"cluster.accelerator={accelerator}"] if accelerator else [])]))


def rows_for(suite: Suite, *, accelerator: str) -> list[Row]:
    from llmforge.hardware import get_profile

    fp8 = get_profile(accelerator).has_fp8
    out = []
    for model, mb in suite.shapes:
        for mode in suite.modes:
            for precision in suite.precisions:
                if precision == "fp8" and not fp8:
                    continue
                for recompute in suite.recomputes:
                    args = overrides(model, mb, mode=mode, precision=precision, recompute=recompute, accelerator=accelerator)
                    out.append(Row(model, mb, mode, precision, recompute, args))
    return out


def measure(rows: list[Row], *, device, steps: int, warmup: int, log, done=lambda: None) -> None:
    """Train each row's plan (and the plain loop once per shape and mode) on ``device``;
    ``done()`` after each row, so a run cut short keeps the rows it measured."""
    import bench_gpu

    from llmforge.estimate import flops
    from llmforge.estimate.shape import from_plan

    plain = {}
    for row in rows:
        plan = plan_of(row.overrides)
        key = (row.model, row.micro_batch, row.mode)
        if key not in plain and row.precision == "bf16":
            bench_gpu._fresh(device)
            plain[key] = bench_gpu.plain_loop(plan, compiled=row.mode == "compiled", warmup=warmup, steps=steps, device=device).tokens_per_s
        bench_gpu._fresh(device)
        result = bench_gpu.llmforge_loop(plan, warmup=warmup, steps=steps, device=device)
        shape, _, job = from_plan(plan)
        row.tokens_per_s, row.peak_bytes, row.plain_tokens_per_s = result.tokens_per_s, result.peak_reserved, plain.get(key)
        row.mfu = result.tokens_per_s * flops.model_flops(shape, 1) / job.profile.peak(job.param_dtype)
        log(f"{row.name}: {row.tokens_per_s:,.0f} tokens/s, {row.peak_bytes / GIB:.2f} GiB")
        done()


def estimate(rows: list[Row], *, before: str, after: Path) -> None:
    """Each row's estimate on the datasheet profile (``before``) and the calibrated one."""
    from llmforge.estimate.core import estimate_plan

    for row in rows:
        for target, accelerator in ((row.before, before), (row.after, str(after))):
            est = estimate_plan(plan_of(row.overrides, accelerator=accelerator))
            reserved = est.job.profile.runtime_reserved_bytes if est.job.profile.name != "cpu" else 0
            target.update(tokens_per_s=est.tokens_per_s, memory=est.worst.total - reserved)


def run(argv: Sequence[str], *, log) -> subprocess.CompletedProcess:
    log("$ " + " ".join(argv))
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True)


def _ratio(measured: float, est: dict, key: str) -> str:
    return f"{measured / est[key]:.2f}x" if est.get(key) else "-"


def table(rows: Sequence[Row]) -> list[str]:
    """The report's first table: measured, the plain loop, and measured / estimate before and after calibration."""
    lines = [
        "| shape | mode | precision | recompute | tokens/s | vs plain | MFU | peak GiB | tokens/s meas/est: datasheet | calibrated "
        "| memory meas/est: datasheet | calibrated |",
        "|" + "---|" * 4 + "---:|" * 8,
    ]
    for r in rows:
        plain = f"{r.tokens_per_s / r.plain_tokens_per_s:.2f}x" if r.plain_tokens_per_s else "-"
        lines.append(
            f"| {r.model} mb{r.micro_batch} | {r.mode} | {r.precision} | {r.recompute} | {r.tokens_per_s:,.0f} | {plain} | {r.mfu:.1%} "
            f"| {r.peak_bytes / GIB:.2f} | {_ratio(r.tokens_per_s, r.before, 'tokens_per_s')} | "
            f"{_ratio(r.tokens_per_s, r.after, 'tokens_per_s')} "
            f"| {_ratio(r.peak_bytes, r.before, 'memory')} | {_ratio(r.peak_bytes, r.after, 'memory')} |"
        )
    return lines


def targets(rows: Sequence[Row]) -> list[str]:
    """The issue's targets on one H100, each with what was measured."""

    def find(model: str, mode: str, recompute: str = "none", precision: str = "bf16") -> Row | None:
        return next((r for r in rows if (r.model, r.mode, r.recompute, r.precision) == (model, mode, recompute, precision)), None)

    out = []
    for mode in ("eager", "compiled"):
        r = find("gpt-125m", mode)
        if r and r.plain_tokens_per_s:
            out.append(
                _check(
                    f"gpt-125m {mode} at or above the plain loop",
                    r.tokens_per_s >= r.plain_tokens_per_s,
                    f"{r.tokens_per_s / r.plain_tokens_per_s:.3f}x",
                )
            )
    r = find("gpt-1b", "compiled")
    if r:
        out.append(_check("gpt-1b compiled at 45% MFU or more", r.mfu >= 0.45, f"{r.mfu:.1%}"))
    for none in (r for r in rows if r.recompute == "none"):
        sel = find(none.model, none.mode, "selective", none.precision)
        if sel:
            out.append(
                _check(
                    f"{sel.model} {sel.mode} {sel.precision}: selective within 5% of none",
                    sel.tokens_per_s >= 0.95 * none.tokens_per_s,
                    f"{sel.tokens_per_s / none.tokens_per_s:.3f}x",
                )
            )
    speed = [abs(r.tokens_per_s / r.after["tokens_per_s"] - 1) for r in rows if r.after]
    memory = [abs(r.peak_bytes / r.after["memory"] - 1) for r in rows if r.after]
    if speed:
        out.append(_check("calibrated estimate within 15% of tokens/s on every shape", max(speed) <= 0.15, f"worst {max(speed):.1%}"))
        out.append(_check("calibrated estimate within 10% of peak memory on every shape", max(memory) <= 0.10, f"worst {max(memory):.1%}"))
    return out


def _check(what: str, ok: bool, got: str) -> str:
    return f"- {'met' if ok else 'MISSED'}: {what} ({got})"


def header(device_name: str, *, smoke: bool) -> list[str]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    title = "llmforge on the CPU (--cpu-smoke: checks the report, not speed)" if smoke else f"llmforge on {device_name}"
    return [f"# {title}", "", f"{datetime.date.today()}, torch {torch.__version__}, commit {commit}, {device_name}", ""]


def report(*, rows: Sequence[Row], device_name: str, smoke: bool, calibration: str, tests: str) -> str:
    lines = header(device_name, smoke=smoke) + table(rows)
    lines += ["", "## Targets", "", *(targets(rows) or ["- (no row of the targets' shapes ran)"])]
    lines += ["", "## Calibration", "", "```", calibration.strip(), "```", "", "## GPU tests", "", tests.strip(), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-report.md"))
    parser.add_argument("--accelerator", default="h100-80gb", help="the datasheet profile of this GPU")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: exercise the pipeline and the report")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a subset (eager/compiled, bf16/fp8, recompute none/selective; quick calibration; "
        "no GPU tests) for a short session on the GPU",
    )
    parser.add_argument("--skip", nargs="*", default=[], help="leave out rows whose name contains any of these words (e.g. fp8 gpt-1b)")
    args = parser.parse_args(argv)
    import torch

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("tools/gpu_report.py needs a CUDA GPU (or --cpu-smoke)")
    suite, accelerator = (SMOKE, "cpu") if smoke else (QUICK if args.quick else GPU, args.accelerator)
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    steps, warmup = (min(args.steps, 3), min(args.warmup, 1)) if smoke else (args.steps, args.warmup)
    device_name = "CPU" if smoke else torch.cuda.get_device_name(device)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    calibrated = args.out.with_suffix(".profile.yaml")
    cal = run(
        [
            sys.executable,
            "-m",
            "llmforge",
            "calibrate",
            f"cluster.accelerator={accelerator}",
            "cluster.devices_per_node=1",
            "--out",
            str(calibrated),
            *suite.calibrate_args,
        ],
        log=log,
    )
    if cal.returncode != 0:
        raise SystemExit(f"llmforge calibrate failed:\n{cal.stderr[-3000:]}")
    rows = [r for r in rows_for(suite, accelerator=accelerator) if not any(word in r.name for word in args.skip)]
    from llmforge.hardware import BUILTIN_DIR

    builtin = BUILTIN_DIR / f"{accelerator}.yaml"  # the datasheet, even where an earlier calibration shadows its name
    estimate(rows, before=str(builtin) if builtin.is_file() else accelerator, after=calibrated)
    calibration = cal.stdout + cal.stderr
    tests = "not run (--cpu-smoke)" if smoke else "not run (--quick)"

    def write() -> None:
        measured = [r for r in rows if r.tokens_per_s]
        args.out.write_text(report(rows=measured, device_name=device_name, smoke=smoke, calibration=calibration, tests=tests))

    measure(rows, device=device, steps=steps, warmup=warmup, log=log, done=write)
    if suite.gpu_tests:
        done = run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q"], log=log)
        tests = f"exit code {done.returncode}:\n\n```\n" + "\n".join(done.stdout.strip().splitlines()[-15:]) + "\n```"
    write()
    log(f"wrote {args.out} (profile: {calibrated})")


if __name__ == "__main__":
    main()
