"""The prepared-data cache: where an entry lives, whether it still matches its input, and
how a new entry replaces an old one without anyone seeing a half-written folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

from filelock import FileLock

from llmforge.files import file_stamp, sha256_file, write_json_atomic

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"


def digest(obj) -> str:
    """SHA-256 of a JSON-serialisable object (stable key order)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def entry_folder(cache_dir: str, *, name: str, spec: dict) -> Path:
    """The cache folder of one preparation request."""
    return Path(cache_dir).expanduser().resolve() / "prepared" / f"{name}-{digest(spec)[:16]}"


@contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold an inter-process lock on a cache entry (concurrent prepare calls wait for the first)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root.parent / f".{root.name}.lock")):
        yield


@contextmanager
def staging(root: Path) -> Iterator[Path]:
    """A temporary sibling folder that replaces root only when the block succeeds."""
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    trash = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
    if root.exists():
        os.replace(root, trash)
    os.replace(tmp, root)
    shutil.rmtree(trash, ignore_errors=True)


def write_manifest(folder: Path, manifest: dict) -> None:
    write_json_atomic(folder / MANIFEST, manifest)


def read_manifest(root: Path) -> Optional[dict]:
    """The entry's manifest, or None if it is missing, unreadable or of another format."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        return None
    return manifest


def stale_reason(root: Path, manifest: dict, *, spec: dict, inputs: List[dict]) -> Optional[str]:
    """Why a cached entry no longer matches its input, or None when it can be reused."""
    if manifest.get("spec") != spec:
        return "the preparation settings changed"
    old = [(f["path"], f["sha256"]) for f in manifest.get("inputs", [])]
    new = [(f["path"], f["sha256"]) for f in inputs]
    if old != new:
        changed = sorted({p for p, _ in set(old) ^ set(new)})
        return f"input changed: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}"
    tok = root / TOKENIZER
    if not tok.is_file() or sha256_file(tok) != manifest.get("tokenizer", {}).get("sha256"):
        return "the cached tokenizer is missing or altered"
    return _shards_problem(root, manifest)


def _shards_problem(root: Path, manifest: dict) -> Optional[str]:
    itemsize = 2 if manifest.get("dtype") == "uint16" else 4
    for stream in manifest.get("streams", []):
        folder = root / stream["folder"]
        if not (folder / "doc_ends.npy").is_file():
            return f"{folder}/doc_ends.npy is missing"
        for shard in stream["shards"]:
            path = folder / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * itemsize:
                return f"shard {path} is missing or truncated"
            altered = _content_problem(path, shard)
            if altered:
                return altered
    return None


def _content_problem(path: Path, shard: dict) -> Optional[str]:
    """A shard whose bytes differ from those written. Hashed only when its stat changed since it
    was written (ctime moves with every write and cannot be set back), so a reuse costs a stat."""
    if "sha256" not in shard:
        return "the cache was written without content hashes of its shards"
    if shard.get("stat") == file_stamp(path):
        return None
    if sha256_file(path) != shard["sha256"]:
        return f"shard {path} was altered after it was written (its SHA-256 differs from the one recorded then)"
    return None
