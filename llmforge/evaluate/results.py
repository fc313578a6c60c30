"""lm-eval's results as llmforge shows and keeps them: flat metrics for ``metrics.jsonl``,
W&B and TensorBoard (``eval/TASK/METRIC``), a Rich table, and the whole results JSON in
``run.dir/evals/step_N.json``, written beside and renamed in."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table

from llmforge.files import write_text_atomic

PREFIX = "eval/"


def rows(results: dict[str, Any]) -> list[tuple[str, str, float, float | None]]:
    """(task, metric, value, stderr or None) for every numeric metric of every task and group."""
    out = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "_stderr," in key or not isinstance(value, int | float) or isinstance(value, bool) or "," not in key:
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}_{filt}"
            err = metrics.get(f"{metric}_stderr,{filt}")
            out.append((task, name, float(value), float(err) if isinstance(err, int | float) else None))
    return out


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``eval/TASK/METRIC`` (and ``..._stderr``) -> value, finite numbers only (JSON has no NaN)."""
    out = {}
    for task, metric, value, err in rows(results):
        if math.isfinite(value):
            out[f"{PREFIX}{task}/{metric}"] = value
        if err is not None and math.isfinite(err):
            out[f"{PREFIX}{task}/{metric}_stderr"] = err
    return out


def table(results: dict[str, Any], *, title: str) -> Table:
    """Each task's metrics with their standard errors."""
    shown = Table(title=title)
    for column in ("task", "metric", "value", "stderr", "n"):
        shown.add_column(column, justify="right" if column in ("value", "stderr", "n") else "left")
    samples = results.get("n-samples", {})
    for task, metric, value, err in rows(results):
        count = samples.get(task, {}).get("effective", "")
        shown.add_row(task, metric, f"{value:.4f}", "" if err is None else f"{err:.4f}", str(count))
    return shown


def write_results(results: dict[str, Any], *, run_dir: Path, step: int) -> Path:
    """``run_dir/evals/step_N.json``: lm-eval's results, replaced whole."""
    from lm_eval.utils import handle_non_serializable

    path = Path(run_dir) / "evals" / f"step_{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {key: value for key, value in results.items() if key != "samples"}
    write_text_atomic(path, json.dumps(kept, indent=1, default=handle_non_serializable, sort_keys=True))
    return path


def drop_results_after(run_dir: Path, *, step: int) -> list[str]:
    """Remove ``evals/step_N.json`` past ``step`` (a resume evaluates those steps again); return their names."""
    folder = Path(run_dir) / "evals"
    dropped = []
    for path in sorted(folder.glob("step_*.json")) if folder.is_dir() else []:
        number = path.stem.removeprefix("step_")
        if number.isdigit() and int(number) > step:
            path.unlink()
            dropped.append(path.name)
    return dropped
