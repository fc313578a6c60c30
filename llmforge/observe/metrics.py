"""metrics.jsonl: one JSON object per logged step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llmforge.files import write_text_atomic


class MetricsFile:
    """Appends one line per logged step and flushes it, so a crash loses nothing logged."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl; lines that are not a JSON object (a write cut short) are skipped."""
    records = (_record(line) for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines())
    return [r for r in records if r is not None]


def tidy_metrics(path: Path, *, after_step: int | None = None) -> list[str]:
    """Before a run appends to ``path``: drop a last line that does not parse (its writer was
    killed mid-line; the next record would be glued onto it) and, with ``after_step``, the
    records past that step (steps that will be trained again). Returns what was dropped,
    as notes for the console."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    notes = []
    if lines and _record(lines[-1]) is None:
        partial = lines.pop()
        shown = partial if len(partial) <= 60 else partial[:60] + "..."
        notes.append(f"{path}: dropped its last line, which is incomplete (a write cut short): {shown}")
    if after_step is not None:
        lines = [line for line in lines if _step_of(line) <= after_step]
    kept = "".join(line + "\n" for line in lines)
    if kept != text:
        write_text_atomic(path, kept)
    return notes


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _step_of(line: str) -> int:
    """A record's step; 0 for a line that is not a record (kept: it predates any resumed step)."""
    try:
        return int((_record(line) or {}).get("step", 0))
    except (TypeError, ValueError):
        return 0
