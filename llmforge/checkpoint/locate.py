"""Find the checkpoint a ``ckpt=PATH`` names: a step folder, a run folder, or ``latest``.

A step folder named explicitly must be intact (a damaged one is an error naming
the file). A run folder, its ``checkpoints/`` folder, or ``.../latest`` means the
newest complete checkpoint: damaged or interrupted newer ones are skipped, and
the notes returned say which and why. An object-storage URL (``s3://bucket/run``,
``.../latest``, ``.../step_N``) is found the same way; its run folder is the local
``run.dir`` of the plan saved with it. A run folder whose plan.json puts its checkpoints in
object storage leads there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmforge.checkpoint import objstore
from llmforge.checkpoint.manifest import MANIFEST, verify
from llmforge.checkpoint.store import _STEP_DIR, step_dirs
from llmforge.errors import UserError, fail
from llmforge.storage import basename, is_url, join, parent, storage_error


@dataclass
class Located:
    """A verified checkpoint folder, its run folder, and what was skipped to find it."""

    path: Any  # a Path, or an object-storage URL (str)
    run_dir: Path
    notes: list[str] = field(default_factory=list)


def checkpoints_root(run_or_root: Path) -> Path:
    """The ``checkpoints`` folder of a run folder (or the folder itself)."""
    return run_or_root if run_or_root.name == "checkpoints" else run_or_root / "checkpoints"


def run_dir_of(step_dir: Path) -> Path:
    """The run folder a step folder belongs to."""
    root = step_dir.parent
    return root.parent if root.name == "checkpoints" else root


def locate(text: str) -> Located:
    """Resolve ``ckpt=`` to a checkpoint whose every file matches its manifest's checksum."""
    if is_url(text):
        try:
            return _locate_url(text.rstrip("/"))
        except UserError:
            raise
        except Exception as exc:  # the storage backend's own errors: credentials, endpoint, bucket
            raise storage_error(exc, url=text, doing="read the checkpoint", key="ckpt") from None
    path = Path(text).expanduser()
    if path.name == "latest":
        if str(path.parent) in ("", "."):
            raise fail("ckpt=latest needs the run: write ckpt=runs/NAME/checkpoints/latest or ckpt=runs/NAME", title="missing checkpoint")
        return _in_run_folder(run_dir_of(path)) or newest_complete(checkpoints_root(path.parent))
    if _STEP_DIR.match(path.name) or (path / MANIFEST).is_file():
        verify(path, checksums=True)
        return Located(path=path, run_dir=run_dir_of(path))
    in_store = _in_run_folder(path)
    if in_store is not None:
        return in_store
    if path.is_dir() and (path.name == "checkpoints" or (path / "checkpoints").is_dir()):
        return newest_complete(checkpoints_root(path))
    if not path.exists():
        raise fail(f"{path}: no such checkpoint, run folder or checkpoints folder", title="missing checkpoint")
    raise fail(f"{path}: neither a checkpoint (step_N with {MANIFEST}) nor a run folder with checkpoints/", title="missing checkpoint")


def _in_run_folder(folder: Path) -> Located | None:
    """The newest complete checkpoint of a run folder whose plan.json puts its checkpoints in
    object storage (None for a run that keeps them in the folder); the run continues in ``folder``."""
    try:
        where = json.loads((folder / "plan.json").read_text())["config"]["checkpoint"]["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not is_url(where):
        return None
    found = locate(where)
    return Located(path=found.path, run_dir=folder, notes=found.notes)


def _locate_url(url: str) -> Located:
    """``locate`` for an object-storage URL: a step prefix, ``ROOT/latest`` or ``ROOT``."""
    if basename(url) == "latest":
        return newest_complete(parent(url))
    if _STEP_DIR.match(basename(url)) or objstore.exists(join(url, MANIFEST)):
        objstore.verify(url, checksums=True)
        return Located(path=url, run_dir=_saved_run_dir(url))
    if objstore.step_dirs(url):
        return newest_complete(url)
    raise fail(f"{url}: no checkpoint (step_N/ with {MANIFEST}) and no step_N/ checkpoints under it", title="missing checkpoint")


def _saved_run_dir(url: str) -> Path:
    """The local run folder a checkpoint in object storage was saved from (its plan's run.dir)."""
    try:
        return Path(objstore.read_json(join(url, "plan.json"))["config"]["run"]["dir"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise fail(f"{join(url, 'plan.json')}: unreadable ({exc})", title="damaged checkpoint") from None


def newest_complete(root: Any) -> Located:
    """The newest checkpoint under ``root`` that verifies; notes name every newer one skipped."""
    notes: list[str] = []
    remote = is_url(root)
    for junk in [] if remote else sorted(root.glob(".tmp-step_*")):
        notes.append(f"ignoring {junk.name}: an interrupted save (no manifest)")
    for candidate in step_dirs(root):
        name = basename(candidate) if remote else candidate.name
        try:
            objstore.verify(candidate, checksums=True) if remote else verify(candidate, checksums=True)
        except UserError as exc:
            notes.append(f"skipping {name}: {exc.problems[0].rule}")
            continue
        if notes:
            notes.append(f"falling back to {name}, the newest complete checkpoint")
        return Located(path=candidate, run_dir=_saved_run_dir(candidate) if remote else run_dir_of(candidate), notes=notes)
    detail = "; ".join(notes) if notes else "no step_N folders"
    raise fail(f"{root}: no complete checkpoint to resume from ({detail})", title="missing checkpoint")
