"""The prepared-data cache: where an entry lives, whether it still matches its input, and
how a new entry replaces an old one without anyone seeing a half-written folder.

A preparation (``preparing``) holds the entry's lock, first removes the temporary folders
that an earlier preparation of the entry left when it died (none can be in use while the
lock is held), and turns a full disk into one message naming the cache folder. SIGTERM
during a preparation removes its temporary folder as SIGINT does, then ends the process
by the signal as before (exit 143), with a message.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

from llmforge.errors import Problem, Terminated, UserError
from llmforge.files import disk_full, file_stamp, sha256_file, write_json_atomic

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
    lock = FileLock(str(root.parent / f".{root.name}.lock"))
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise cache_write_error(root, exc) from None
    try:
        yield
    finally:
        lock.release()


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST)


class CacheNotWritable(UserError):
    """The cache folder cannot be written (a prepared entry there can still be read)."""


def leftovers(root: Path) -> list[Path]:
    """Temporary and replaced folders an earlier preparation of the entry left."""
    return [p for pattern in (f".{root.name}.tmp-*", f".{root.name}.old-*") for p in root.parent.glob(pattern)]


def cache_write_error(root: Path, exc: OSError) -> UserError:
    """One message for a cache folder that cannot be written: a file in the way, a folder where
    the lock file goes, no permission or a read-only file system."""
    folder, lock = root.parent.parent, root.parent / f".{root.name}.lock"
    blocker = next((p for p in [root.parent, *root.parent.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        rule, fix = f"{blocker} is a file, not a folder", "remove that file, or set data.cache_dir to a folder"
    elif lock.is_dir():
        rule, fix = f"the lock file's place, {lock}, is taken by a folder", "remove that folder (it holds no data)"
    else:
        rule = f"cannot write in {root.parent} ({exc.strerror or exc}) to prepare {root.name}"
        fix = (
            "set data.cache_dir to a writable folder, or have a user who can write there prepare it once "
            "(`llmforge data prepare` with the same data settings): a prepared cache is then only read"
        )
    return CacheNotWritable([Problem("data.cache_dir", str(folder), rule, fix)], title="cannot use the data cache")


@contextmanager
def preparing(root: Path, *, input_bytes: int) -> Iterator[None]:
    """Hold the entry's lock while it is checked or rebuilt; see the module docstring."""
    try:
        with locked(root), sigterm_unwinds():
            remove_stale_temporaries(root)
            yield
    except Terminated:
        sys.stderr.write(f"stopped by SIGTERM while preparing {root}; its temporary folder was removed\n")
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in _UNWRITABLE and str(exc.filename or "").startswith(str(root.parent)):
            raise cache_write_error(root, exc) from None
        if not disk_full(exc):
            raise
        raise disk_full_error(root, need_bytes=2 * input_bytes) from None


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Delete the entry's temporary and replaced folders; call only while holding its lock."""
    stale = leftovers(root)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Route SIGTERM to Terminated while nobody else handles it (a training loop's own handler is kept)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def disk_full_error(root: Path, *, need_bytes: int) -> UserError:
    """One message: the cache folder, about how much a preparation needs, how much is free."""
    folder = root.parent.parent
    free = shutil.disk_usage(folder).free
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    capped = f"; files are also limited to {_mb(limit)} each by `ulimit -f`" if limit != resource.RLIM_INFINITY else ""
    needs = f"it needs about {_mb(need_bytes)} (a copy of the text and its token shards) and " if need_bytes else ""
    return UserError(
        [
            Problem(
                "data.cache_dir",
                str(folder),
                f"the disk filled up while preparing {root.name}: {needs}"
                f"the file system has {_mb(free)} free{capped}; the partial entry was removed",
                ("raise the limit (ulimit -f unlimited), " if capped else "")
                + "free space there or set data.cache_dir to a folder on a larger disk, then run again",
            )
        ],
        title="no space for the prepared data",
    )


def _mb(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


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


def read_manifest(root: Path) -> dict | None:
    """The entry's manifest, or None if it is missing, unreadable or of another format."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        return None
    return manifest


def stale_reason(root: Path, manifest: dict, *, spec: dict, inputs: list[dict]) -> str | None:
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


def _shards_problem(root: Path, manifest: dict) -> str | None:
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


def _content_problem(path: Path, shard: dict) -> str | None:
    """A shard whose bytes differ from those written. Hashed only when its stat changed since it
    was written (ctime moves with every write and cannot be set back), so a reuse costs a stat."""
    if "sha256" not in shard:
        return "the cache was written without content hashes of its shards"
    if shard.get("stat") == file_stamp(path):
        return None
    if sha256_file(path) != shard["sha256"]:
        return f"shard {path} was altered after it was written (its SHA-256 differs from the one recorded then)"
    return None
