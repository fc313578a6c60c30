"""Find the checkpoint a ``ckpt=PATH`` names: a step folder, a run folder, or ``latest``.

A step folder named explicitly must be intact (a damaged one is an error naming
the file). A run folder, its ``checkpoints/`` folder, or ``.../latest`` means the
newest complete checkpoint: damaged or interrupted newer ones are skipped, and
the notes returned say which and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from llmforge.checkpoint.manifest import MANIFEST, verify
from llmforge.checkpoint.store import _STEP_DIR, step_dirs
from llmforge.errors import UserError, fail


@dataclass
class Located:
    """A verified checkpoint folder, its run folder, and what was skipped to find it."""

    path: Path
    run_dir: Path
    notes: List[str] = field(default_factory=list)


def checkpoints_root(run_or_root: Path) -> Path:
    """The ``checkpoints`` folder of a run folder (or the folder itself)."""
    return run_or_root if run_or_root.name == "checkpoints" else run_or_root / "checkpoints"


def run_dir_of(step_dir: Path) -> Path:
    """The run folder a step folder belongs to."""
    root = step_dir.parent
    return root.parent if root.name == "checkpoints" else root


def locate(text: str) -> Located:
    """Resolve ``ckpt=`` to a checkpoint whose every file matches its manifest's checksum."""
    path = Path(text).expanduser()
    if path.name == "latest":
        if str(path.parent) in ("", "."):
            raise fail("ckpt=latest needs the run: write ckpt=runs/NAME/checkpoints/latest or ckpt=runs/NAME", title="missing checkpoint")
        return newest_complete(checkpoints_root(path.parent))
    if _STEP_DIR.match(path.name) or (path / MANIFEST).is_file():
        verify(path, checksums=True)
        return Located(path=path, run_dir=run_dir_of(path))
    if path.is_dir() and (path.name == "checkpoints" or (path / "checkpoints").is_dir()):
        return newest_complete(checkpoints_root(path))
    if not path.exists():
        raise fail(f"{path}: no such checkpoint, run folder or checkpoints folder", title="missing checkpoint")
    raise fail(f"{path}: neither a checkpoint (step_N with {MANIFEST}) nor a run folder with checkpoints/", title="missing checkpoint")


def newest_complete(root: Path) -> Located:
    """The newest checkpoint under ``root`` that verifies; notes name every newer one skipped."""
    notes: List[str] = []
    for junk in sorted(root.glob(".tmp-step_*")):
        notes.append(f"ignoring {junk.name}: an interrupted save (no manifest)")
    for candidate in step_dirs(root):
        try:
            verify(candidate, checksums=True)
        except UserError as exc:
            notes.append(f"skipping {candidate.name}: {exc.problems[0].rule}")
            continue
        if notes:
            notes.append(f"falling back to {candidate.name}, the newest complete checkpoint")
        return Located(path=candidate, run_dir=run_dir_of(candidate), notes=notes)
    detail = "; ".join(notes) if notes else "no step_N folders"
    raise fail(f"{root}: no complete checkpoint to resume from ({detail})", title="missing checkpoint")
