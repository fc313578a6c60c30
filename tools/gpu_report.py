"""The GPU truth in one command: markdown and JSON of what llmforge does on this GPU.

    python tools/gpu_report.py [--out gpu-report.md] [--accelerator h200-141gb] [--steps 15] [--warmup 5]
    python tools/gpu_report.py --cpu-smoke --out /tmp/smoke.md    # the same pipeline on tiny CPU shapes

On a GPU it runs, in one process (a fresh machine costs minutes), within ``--budget-s``
(480 s: rows that would start after it are listed as not run):

1. ``llmforge calibrate --quick cluster.accelerator=ACC cluster.devices_per_node=1`` into the
   report's folder (the measured profile next to the datasheet one);
2. ``tools/bench_gpu.py``'s loops: gpt-125m (micro batch 8) and gpt-1b (micro batch 4), eager
   and compiled, bf16 and fp8 (tensorwise, where the profile has FP8), recompute none and
   selective; llama-8b cut to 2 layers (width 4096, seq 2048, micro batch 4), compiled, bf16
   and fp8; and the plain PyTorch loop (``tools/plain_gpt.py``) once per shape and mode;
3. the estimate of each of those plans with the datasheet profile and with the calibrated
   one: step time and peak memory, as measured / estimate;
4. with ``--tests``, the ``gpu``-marked tests (``python -m pytest -m gpu tests/gpu``);

and writes the report (``--out``, and the rows as JSON beside it): the table first, then the
targets (gpt-125m at or above the plain loop, gpt-1b compiled bf16 at 55% MFU or more,
compiled selective within 3% of none, fp8 compiled at least 1.10x bf16 on gpt-1b and 1.25x on
the 4096-wide shape and never below 0.97x, the calibrated estimate within 10% of step time
and 5% of peak memory), the calibration's table and the tests' summary. The plain loop is a
GPT: against llama's blocks (SwiGLU, GQA) "vs plain" compares the two loops' model FLOP rates.

``--cpu-smoke`` runs the same steps on the CPU on gpt-tiny (eager, bf16, recompute
none and selective, a few steps, no GPU tests): it checks that the report is assembled, not
how fast anything is.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    """One model shape of the report and the runs it gets."""

    name: str
    overrides: tuple[str, ...]
    micro_batch: int
    modes: tuple[str, ...]
    precisions: tuple[str, ...]
    recomputes: tuple[str, ...]


@dataclass(frozen=True)
class Suite:
    """What one report measures."""

    shapes: Sequence[Shape]
    calibrate_args: Sequence[str]


BOTH, BF16_FP8, NONE_SELECTIVE = ("eager", "compiled"), ("bf16", "fp8"), ("none", "selective")
LLAMA_2_LAYERS = ("model=llama-8b", "model.num_layers=2", "model.seq_len=2048")
GPU = Suite(
    (
        Shape("gpt-125m", ("model=gpt-125m",), 8, BOTH, BF16_FP8, NONE_SELECTIVE),
        Shape("gpt-1b", ("model=gpt-1b",), 4, BOTH, BF16_FP8, NONE_SELECTIVE),
        Shape("llama-8b 2 layers", LLAMA_2_LAYERS, 4, ("compiled",), BF16_FP8, ("none",)),
    ),
    ("--quick",),
)
SMOKE = Suite((Shape("gpt-tiny", ("model=gpt-tiny",), 2, ("eager",), ("bf16",), NONE_SELECTIVE),), ("--quick",))


@dataclass
class Row:
    model: str
    micro_batch: int
    mode: str
    precision: str
    recompute: str
    overrides: list[str]
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    peak_bytes: float = 0.0
    plain_ratio: float | None = None  # llmforge's model FLOP rate over the plain loop's
    mfu: float = 0.0
    before: dict = field(default_factory=dict)  # estimate with the datasheet profile: step_s, memory
    after: dict = field(default_factory=dict)  # with the calibrated profile

    @property
    def name(self) -> str:
        return f"{self.model} mb{self.micro_batch} {self.mode} {self.precision} {self.recompute}"


def overrides(shape: Shape, *, mode: str, precision: str, recompute: str, accelerator: str) -> list[str]:
    mb = shape.micro_batch
    out = [
        *shape.overrides,
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
    """The suite's rows, the bf16 rows without recompute first (each shape's plain-loop
    comparison), then fp8, then selective recompute: a run cut short keeps the first."""
    from llmforge.hardware import get_profile

    fp8 = get_profile(accelerator).has_fp8
    out = []
    for shape in suite.shapes:
        for mode in shape.modes:
            for precision in (p for p in shape.precisions if p != "fp8" or fp8):
                for recompute in shape.recomputes:
                    args = overrides(shape, mode=mode, precision=precision, recompute=recompute, accelerator=accelerator)
                    out.append(Row(shape.name, shape.micro_batch, mode, precision, recompute, args))
    return sorted(out, key=lambda r: (r.recompute != "none", r.precision != "bf16"))


#: The plain loop's blocks (``tools/plain_gpt.py``) at a plan's widths: what its FLOPs are counted as.
PLAIN_BLOCKS = ("model.norm=layernorm", "model.activation=gelu", "model.position=learned", "model.num_kv_heads=null")


def _plain(row: Row, *, device, steps: int, warmup: int, cache: dict) -> tuple[float, float]:
    """(tokens/s, model FLOPs per token) of the plain GPT loop at this row's widths, once per shape and mode."""
    import bench_gpu

    from llmforge.estimate import flops
    from llmforge.estimate.shape import from_plan

    key = (row.model, row.micro_batch, row.mode)
    if key not in cache:
        plan = plan_of([*row.overrides, *PLAIN_BLOCKS])
        bench_gpu._fresh(device)
        result = bench_gpu.plain_loop(plan, compiled=row.mode == "compiled", warmup=warmup, steps=steps, device=device)
        cache[key] = (result.tokens_per_s, flops.model_flops(from_plan(plan)[0], 1))
    return cache[key]


def measure(rows: list[Row], *, device, steps: int, warmup: int, log, deadline: float, done=lambda: None) -> list[str]:
    """Train each row's plan (and the plain loop once per shape and mode) on ``device``;
    ``done()`` after each row, so a run cut short keeps the rows it measured. Rows that would
    start after ``deadline`` (``time.monotonic()``) are skipped and a row that fails is logged:
    their names are returned."""
    import bench_gpu

    from llmforge.estimate import flops
    from llmforge.estimate.shape import from_plan

    plain: dict = {}
    skipped = []
    for row in rows:
        if time.monotonic() > deadline:
            skipped.append(row.name)
            continue
        plan = plan_of(row.overrides)
        shape, _, job = from_plan(plan)
        per_token = flops.model_flops(shape, 1)
        try:
            plain_tokens_per_s, plain_per_token = _plain(row, device=device, steps=steps, warmup=warmup, cache=plain)
            bench_gpu._fresh(device)
            result = bench_gpu.llmforge_loop(plan, warmup=warmup, steps=steps, device=device)
        except Exception as e:  # one row's failure (a missing torchao, memory) must not cost the others
            log(f"{row.name}: failed: {type(e).__name__}: {e}")
            skipped.append(f"{row.name} (failed: {type(e).__name__}: {str(e)[:200]})")
            continue
        row.tokens_per_s, row.peak_bytes = result.tokens_per_s, result.peak_reserved
        row.step_s = plan.tokens_per_step / result.tokens_per_s
        row.plain_ratio = result.tokens_per_s * per_token / (plain_tokens_per_s * plain_per_token)
        row.mfu = result.tokens_per_s * per_token / job.profile.peak(job.param_dtype)
        gib = row.peak_bytes / GIB
        log(f"{row.name}: {row.tokens_per_s:,.0f} tokens/s, {row.plain_ratio:.2f}x plain, {gib:.2f} GiB; {result.compiles}")
        done()
    return skipped


def estimate(rows: list[Row], *, before: str, after: Path) -> None:
    """Each row's estimate on the datasheet profile (``before``) and the calibrated one."""
    from llmforge.estimate.core import estimate_plan

    for row in rows:
        for target, accelerator in ((row.before, before), (row.after, str(after))):
            plan = plan_of(row.overrides, accelerator=accelerator)
            est = estimate_plan(plan)
            reserved = est.job.profile.runtime_reserved_bytes if est.job.profile.name != "cpu" else 0
            target.update(step_s=plan.tokens_per_step / est.tokens_per_s, memory=est.worst.total - reserved)


def run(argv: Sequence[str], *, log) -> subprocess.CompletedProcess:
    log("$ " + " ".join(argv))
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True)


def _ratio(measured: float, est: dict, key: str) -> str:
    return f"{measured / est[key]:.2f}x" if est.get(key) else "-"


def table(rows: Sequence[Row]) -> list[str]:
    """The report's first table: measured, the plain loop, and measured / estimate before and after calibration."""
    lines = [
        "| shape | mode | precision | recompute | tokens/s | vs plain | MFU | step ms | peak GiB | step time meas/est: datasheet "
        "| calibrated | memory meas/est: datasheet | calibrated |",
        "|" + "---|" * 4 + "---:|" * 9,
    ]
    for r in rows:
        plain = f"{r.plain_ratio:.2f}x" if r.plain_ratio else "-"
        lines.append(
            f"| {r.model} mb{r.micro_batch} | {r.mode} | {r.precision} | {r.recompute} | {r.tokens_per_s:,.0f} | {plain} | {r.mfu:.1%} "
            f"| {1e3 * r.step_s:.1f} | {r.peak_bytes / GIB:.2f} "
            f"| {_ratio(r.step_s, r.before, 'step_s')} | {_ratio(r.step_s, r.after, 'step_s')} "
            f"| {_ratio(r.peak_bytes, r.before, 'memory')} | {_ratio(r.peak_bytes, r.after, 'memory')} |"
        )
    return lines


def _find(rows: Sequence[Row], model: str, mode: str, recompute: str = "none", precision: str = "bf16") -> Row | None:
    return next((r for r in rows if (r.model, r.mode, r.recompute, r.precision) == (model, mode, recompute, precision)), None)


def targets(rows: Sequence[Row]) -> list[str]:
    """The targets on one GPU, each with what was measured."""
    out = []
    for mode in ("eager", "compiled"):
        r = _find(rows, "gpt-125m", mode)
        if r and r.plain_ratio:
            out.append(_check(f"gpt-125m {mode} at or above the plain loop", r.plain_ratio >= 1.0, f"{r.plain_ratio:.3f}x"))
    r = _find(rows, "gpt-1b", "compiled")
    if r:
        out.append(_check("gpt-1b compiled bf16 at 55% MFU or more", r.mfu >= 0.55, f"{r.mfu:.1%}"))
    for sel in (r for r in rows if r.recompute == "selective" and r.mode == "compiled"):
        none = _find(rows, sel.model, sel.mode, "none", sel.precision)
        if none:
            ratio = sel.tokens_per_s / none.tokens_per_s
            out.append(_check(f"{sel.model} compiled {sel.precision}: selective within 3% of none", ratio >= 0.97, f"{ratio:.3f}x"))
    return out + _fp8_targets(rows) + _estimate_targets(rows)


def _fp8_targets(rows: Sequence[Row]) -> list[str]:
    out = []
    wanted = {"gpt-1b": 1.10, "llama-8b 2 layers": 1.25}
    for fp8 in (r for r in rows if r.precision == "fp8"):
        bf16 = _find(rows, fp8.model, fp8.mode, fp8.recompute, "bf16")
        if bf16 is None:
            continue
        ratio = fp8.tokens_per_s / bf16.tokens_per_s
        floor = wanted.get(fp8.model, 0.97) if fp8.mode == "compiled" and fp8.recompute == "none" else 0.97
        out.append(_check(f"{fp8.name}: fp8 at least {floor:.2f}x bf16", ratio >= floor, f"{ratio:.3f}x"))
    return out


def _estimate_targets(rows: Sequence[Row]) -> list[str]:
    speed = [abs(r.step_s / r.after["step_s"] - 1) for r in rows if r.after]
    memory = [abs(r.peak_bytes / r.after["memory"] - 1) for r in rows if r.after]
    if not speed:
        return []
    return [
        _check("calibrated estimate within 10% of step time on every row", max(speed) <= 0.10, f"worst {max(speed):.1%}"),
        _check("calibrated estimate within 5% of peak memory on every row", max(memory) <= 0.05, f"worst {max(memory):.1%}"),
    ]


def _check(what: str, ok: bool, got: str) -> str:
    return f"- {'met' if ok else 'MISSED'}: {what} ({got})"


def header(device_name: str, *, smoke: bool) -> list[str]:
    import torch

    title = "llmforge on the CPU (--cpu-smoke: checks the report, not speed)" if smoke else f"llmforge on {device_name}"
    return [f"# {title}", "", f"{datetime.date.today()}, torch {torch.__version__}, commit {_commit()}, {device_name}", ""]


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"


def report(*, rows: Sequence[Row], skipped: Sequence[str], device_name: str, smoke: bool, calibration: str, tests: str) -> str:
    lines = header(device_name, smoke=smoke) + table(rows)
    if skipped:
        lines += ["", f"Not run (past --budget-s, or failed): {'; '.join(skipped)}."]
    lines += ["", "## Targets", "", *(targets(rows) or ["- (no row of the targets' shapes ran)"])]
    lines += ["", "## Calibration", "", "```", calibration.strip(), "```", "", "## GPU tests", "", tests.strip(), ""]
    return "\n".join(lines)


def write(out: Path, *, rows: Sequence[Row], skipped: Sequence[str], device_name: str, smoke: bool, calibration: str, tests: str) -> None:
    """The markdown report at ``out`` and its rows as JSON beside it (``.json``)."""
    measured = [r for r in rows if r.tokens_per_s]
    out.write_text(report(rows=measured, skipped=skipped, device_name=device_name, smoke=smoke, calibration=calibration, tests=tests))
    data = {"device": device_name, "commit": _commit(), "rows": [dataclasses.asdict(r) for r in measured], "not_run": list(skipped)}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")


def calibrate(suite: Suite, *, accelerator: str, out: Path, log: Callable[[str], None]) -> str:
    """Calibrate this device into ``out``; what the calibration printed."""
    args = ["calibrate", f"cluster.accelerator={accelerator}", "cluster.devices_per_node=1", "--out", str(out), *suite.calibrate_args]
    cal = run([sys.executable, "-m", "llmforge", *args], log=log)
    if cal.returncode != 0:
        raise SystemExit(f"llmforge calibrate failed:\n{cal.stderr[-3000:]}")
    return cal.stdout + cal.stderr


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-report.md"))
    parser.add_argument("--accelerator", default="h200-141gb", help="the datasheet profile of this GPU")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per row first (compile happens in them)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no row after this many seconds")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: exercise the pipeline and the report")
    parser.add_argument("--tests", action="store_true", help="also run the gpu-marked tests after the rows")
    parser.add_argument("--skip", nargs="*", default=[], help="leave out rows whose name contains any of these words (e.g. fp8 gpt-1b)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    import torch

    started = time.monotonic()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("tools/gpu_report.py needs a CUDA GPU (or --cpu-smoke)")
    suite, accelerator = (SMOKE, "cpu") if smoke else (GPU, args.accelerator)
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    steps, warmup = (min(args.steps, 3), min(args.warmup, 1)) if smoke else (args.steps, args.warmup)
    device_name = "CPU" if smoke else torch.cuda.get_device_name(device)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    calibrated = args.out.with_suffix(".profile.yaml")
    calibration = calibrate(suite, accelerator=accelerator, out=calibrated, log=log)
    rows = [r for r in rows_for(suite, accelerator=accelerator) if not any(word in r.name for word in args.skip)]
    from llmforge.hardware import BUILTIN_DIR

    builtin = BUILTIN_DIR / f"{accelerator}.yaml"  # the datasheet, even where an earlier calibration shadows its name
    estimate(rows, before=str(builtin) if builtin.is_file() else accelerator, after=calibrated)
    facts = {"device_name": device_name, "smoke": smoke, "calibration": calibration}
    tests, skipped = ("not run (--cpu-smoke)" if smoke else "not run (no --tests)"), []
    done = lambda: write(args.out, rows=rows, skipped=skipped, tests=tests, **facts)  # noqa: E731
    skipped += measure(rows, device=device, steps=steps, warmup=warmup, log=log, deadline=started + args.budget_s, done=done)
    if args.tests and not smoke:
        ran = run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q"], log=log)
        tests = f"exit code {ran.returncode}:\n\n```\n" + "\n".join(ran.stdout.strip().splitlines()[-15:]) + "\n```"
    write(args.out, rows=rows, skipped=skipped, tests=tests, **facts)
    log(f"wrote {args.out} and {args.out.with_suffix('.json')} (profile: {calibrated}) in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
