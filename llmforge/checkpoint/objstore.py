"""Checkpoints under an object-storage URL (``s3://bucket/run``): listing, the manifest,
publication, rotation.

Object stores have no rename, so a checkpoint is written in place under ``ROOT/step_N/``
and published by its manifest, the last object written: the manifest lists every other
object with its size and SHA-256 (hashed by reading each object back once it is stored).
A reader takes a ``step_N/`` only when its manifest exists and every object matches it, so
a save killed at any moment leaves a prefix without a manifest, which is skipped and
cleared by the next save. Removal runs the other way round: the manifest goes first (the
checkpoint stops counting at once), then the objects; setting a checkpoint aside (a
superseded or diverged history) moves its manifest first.

Every function takes URLs (``str``) and imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

from llmforge.checkpoint.manifest import FORMAT, MANIFEST, TRAIN_STATE, file_problems, parse_manifest
from llmforge.errors import Problem, UserError, fail
from llmforge.storage import basename, filesystem, join, parent, storage_error

_STEP = re.compile(r"^step_(\d+)$")
_CHUNK = 8 * 1024 * 1024


def _fs(url: str) -> Any:
    fs = filesystem(url)
    fs.invalidate_cache()  # another process (rank, run) may have written since the last listing
    return fs


def _url(fs: Any, path: str) -> str:
    return fs.unstrip_protocol(path.rstrip("/"))


def children(url: str) -> list[str]:
    """The prefixes ("folders") right under ``url``, as URLs (none when it does not exist)."""
    fs = _fs(url)
    try:
        entries = fs.ls(url, detail=True)
    except FileNotFoundError:
        return []
    except Exception as exc:  # the backend's own error types
        raise storage_error(exc, url=url, doing="list the checkpoints") from None
    return [_url(fs, e["name"]) for e in entries if e.get("type") == "directory"]


def step_dirs(root: str) -> list[str]:
    """``step_N`` prefixes under ``root``, newest first (complete or not)."""
    found = [u for u in children(root) if _STEP.match(basename(u))]
    return sorted(found, key=step_of, reverse=True)


def step_of(url: str) -> int:
    """N of a ``.../step_N`` URL."""
    return int(_STEP.match(basename(url)).group(1))  # type: ignore[union-attr]


def exists(url: str) -> bool:
    """Whether an object exists."""
    return bool(_fs(url).exists(url))


def complete(root: str) -> list[str]:
    """Step prefixes that carry a manifest, newest first."""
    return [u for u in step_dirs(root) if exists(join(u, MANIFEST))]


def newest_before(root: str, *, step: int) -> str | None:
    """The newest complete checkpoint saved before ``step``, or None."""
    return next((u for u in complete(root) if step_of(u) < step), None)


def objects(prefix: str) -> dict[str, int]:
    """Every object under ``prefix`` (relative name -> size), the manifest excluded."""
    fs = _fs(prefix)
    base = fs._strip_protocol(prefix).rstrip("/") + "/"
    found = fs.find(prefix, detail=True)
    return {name[len(base) :]: int(info["size"]) for name, info in found.items() if name.startswith(base) and name[len(base) :] != MANIFEST}


def sha256(url: str) -> str:
    """Hex SHA-256 of an object, streamed."""
    digest = hashlib.sha256()
    with _fs(url).open(url, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(url: str, data: object) -> None:
    """One object holding ``data`` as JSON (an object appears whole or not at all)."""
    filesystem(url).pipe_file(url, json.dumps(data, indent=1, sort_keys=True).encode())


def read_json(url: str) -> Any:
    """The JSON content of an object."""
    return json.loads(_fs(url).cat_file(url))


def write_manifest(prefix: str, *, step: int) -> dict[str, dict]:
    """Hash every stored object under ``prefix`` and write the manifest, which publishes it."""
    files = {rel: {"size": size, "sha256": sha256(join(prefix, rel))} for rel, size in sorted(objects(prefix).items())}
    write_json(join(prefix, MANIFEST), {"format": FORMAT, "step": step, "files": files})
    return files


def read_manifest(prefix: str) -> dict:
    """The parsed manifest of a step prefix, or a UserError naming what is wrong."""
    url = join(prefix, MANIFEST)
    try:
        text = _fs(url).cat_file(url).decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise fail(
            f"{url}: the manifest is missing, so {prefix} is not a complete checkpoint (the save was interrupted or objects were removed)",
            title="damaged checkpoint",
        ) from None
    return parse_manifest(text, where=url)


def verify(prefix: str, *, checksums: bool) -> dict:
    """Check a checkpoint under ``prefix`` against its manifest (as ``manifest.verify``)."""
    data = read_manifest(prefix)
    problems = file_problems(
        data,
        present=objects(prefix),
        show=lambda rel: join(prefix, rel),
        name=basename(prefix),
        digest=(lambda rel: sha256(join(prefix, rel))) if checksums else None,
    )
    if not problems:
        saved = read_train_state(prefix)["step"]
        if saved != int(data["step"]):
            problems = [f"{join(prefix, TRAIN_STATE)}: records step {saved}, but {join(prefix, MANIFEST)} records step {data['step']}"]
    if problems:
        raise UserError([Problem("", "", p, "") for p in problems], title=f"damaged checkpoint {prefix}")
    return data


def read_train_state(prefix: str) -> dict:
    """``train_state.json`` of a checkpoint, or a UserError naming it as damaged."""
    url = join(prefix, TRAIN_STATE)
    try:
        data = read_json(url)
        if not isinstance(data, dict) or not isinstance(data.get("step"), int):
            raise ValueError("no integer step")
        return data
    except (OSError, ValueError) as exc:
        raise fail(f"{url}: unreadable ({exc}); the checkpoint is damaged, resume from another one", title="damaged checkpoint") from None


def remove(prefix: str) -> None:
    """Unpublish (manifest first), then delete every object under ``prefix``."""
    fs = _fs(prefix)
    manifest = join(prefix, MANIFEST)
    if fs.exists(manifest):
        fs.rm_file(manifest)
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)


def rotate(root: str, *, keep: int, protect: Iterable[int] = ()) -> list[str]:
    """Remove complete checkpoints beyond the ``keep`` newest, as ``store.rotate`` does."""
    done = complete(root)
    kept = {next((u for u in done if step_of(u) < s), None) for s in protect}
    removed = []
    for old in done[max(keep, 1) :] if keep > 0 else []:
        if old not in kept:
            remove(old)
            removed.append(old)
    return removed


def clear_stale(root: str) -> None:
    """Remove what interrupted saves and removals left: step prefixes without a manifest."""
    for prefix in step_dirs(root):
        if not exists(join(prefix, MANIFEST)):
            remove(prefix)


def set_aside(prefix: str, *, name: str) -> str:
    """Move a checkpoint to ``parent/name`` (its manifest first, so it stops counting at once)."""
    fs = _fs(prefix)
    target = join(parent(prefix), name)
    remove(target)  # an earlier copy set aside under the same name: never mix the two
    manifest = join(prefix, MANIFEST)
    if fs.exists(manifest):
        fs.mv(manifest, join(target, MANIFEST))
    for rel in objects(prefix):
        fs.mv(join(prefix, rel), join(target, rel))
    return target
