"""The manifest of a checkpoint: every file with its size and SHA-256.

A checkpoint folder counts as complete only when ``manifest.json`` is present and
every file it lists exists with the recorded size (and, when asked, checksum).
The manifest is written last, inside the temporary folder, before the folder is
renamed into place; a folder without one is an interrupted save.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from llmforge.errors import Problem, UserError, fail
from llmforge.files import sha256_file, write_json_atomic

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
#: What every checkpoint holds besides tensor shards (DCP's index, the JSON state, the plan).
REQUIRED = (".metadata", TRAIN_STATE, "plan.json")
FORMAT = "llmforge-checkpoint/1"


def write_manifest(folder: Path, *, step: int) -> dict[str, dict]:
    """Checksum every file under ``folder`` and write the manifest (last)."""
    files: dict[str, dict] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        with path.open("rb") as fh:
            os.fsync(fh.fileno())
        files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    write_json_atomic(folder / MANIFEST, {"format": FORMAT, "step": step, "files": files}, durable=True)
    return files


def read_manifest(folder: Path) -> dict:
    """The parsed manifest, or a UserError naming what is wrong with it."""
    path = folder / MANIFEST
    if not path.is_file():
        raise fail(
            f"{path}: the manifest is missing, so {folder} is not a complete checkpoint (the save was interrupted or files were removed)",
            title="damaged checkpoint",
        )
    return parse_manifest(path.read_text(encoding="utf-8"), where=str(path))


def verify(folder: Path, *, checksums: bool) -> dict:
    """Check a checkpoint against its manifest; raise one UserError naming each bad file.

    With ``checksums=False`` only presence and sizes are checked (cheap enough for
    every rank at start-up); the full check runs before launch."""
    folder = Path(folder)
    if not folder.is_dir():
        raise fail(f"{folder}: no such checkpoint folder", title="missing checkpoint")
    data = read_manifest(folder)
    present = {rel: (folder / rel).stat().st_size for rel in _files(folder)}
    problems = file_problems(
        data,
        present=present,
        show=lambda rel: str(folder / rel),
        name=folder.name,
        digest=(lambda rel: sha256_file(folder / rel)) if checksums else None,
    )
    problems = problems or _step_problems(folder, data)
    if problems:
        raise UserError([_problem(p) for p in problems], title=f"damaged checkpoint {folder}")
    return data


def file_problems(
    data: dict, *, present: dict[str, int], show: Callable[[str], str], name: str, digest: Callable[[str], str] | None
) -> list[str]:
    """What is wrong with a checkpoint's files (``present``: path -> size, the manifest
    excluded) against its manifest ``data``: unlisted, missing, resized or (with ``digest``)
    changed files, required files the manifest lacks, and a step that is not the folder's."""
    manifest, listed = show(MANIFEST), set(data["files"])
    problems = [f"{show(rel)}: not listed in {manifest}" for rel in sorted(set(present) - listed)]
    problems += [f"{manifest}: does not list {req}, which every checkpoint has" for req in REQUIRED if req not in listed]
    match = re.match(r"^step_(\d+)$", name)
    step = int(data["step"])
    if match and int(match.group(1)) != step:
        problems.append(f"{manifest}: records step {step}, but the folder is {name}")
    for rel, entry in sorted(data["files"].items()):
        if rel not in present:
            problems.append(f"{show(rel)}: missing (listed in the manifest)")
        elif present[rel] != entry["size"]:
            kind = "truncated" if present[rel] < entry["size"] else "larger than recorded"
            problems.append(f"{show(rel)}: {kind} ({present[rel]} bytes, the manifest records {entry['size']})")
        elif digest is not None and digest(rel) != entry["sha256"]:
            problems.append(f"{show(rel)}: checksum mismatch (the file was modified or corrupted)")
    return problems


def parse_manifest(text: str, *, where: str) -> dict:
    """A manifest's content, or a UserError naming ``where`` it came from."""
    try:
        data = json.loads(text)
        files = data["files"]
        int(data["step"])
        if data.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"unknown format {data.get('format')!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise fail(f"{where}: the manifest is unreadable ({exc})", title="damaged checkpoint") from None
    return data


def _step_problems(folder: Path, data: dict) -> list[str]:
    """The train state (whose every byte matched the manifest) must be at the manifest's step."""
    saved, step = read_train_state(folder)["step"], int(data["step"])
    return [] if saved == step else [f"{folder / TRAIN_STATE}: records step {saved}, but {folder / MANIFEST} records step {step}"]


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}


def read_train_state(folder: Path) -> dict:
    """``train_state.json`` of a checkpoint, or a UserError naming it as damaged."""
    path = Path(folder) / TRAIN_STATE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("step"), int):
            raise ValueError("no integer step")
        return data
    except (OSError, ValueError) as exc:
        raise fail(f"{path}: unreadable ({exc}); the checkpoint is damaged, resume from another one", title="damaged checkpoint") from None


def _problem(text: str):
    return Problem(key="", value="", rule=text, fix="")
