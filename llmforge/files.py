"""File helpers shared by the run folder, checkpoints and the data cache: a file's
SHA-256 and stat stamp, and writes that never leave a half-written file behind.

A write goes to a temporary sibling (named after the file and this process, so two
processes writing the same file on a shared file system never share one) and is
renamed over the target: readers see the old content or the new, never a part.

This module imports no torch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from pathlib import Path

_CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def file_stamp(path: Path) -> list:
    """[size, mtime_ns, ctime_ns]: any write to the file changes it (a user can set mtime back, not ctime)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def write_text_atomic(path: Path, text: str, *, durable: bool = False) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one rename. ``durable``: fsync the data
    before the rename, so that a crash of the machine cannot leave an empty file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: object, *, durable: bool = False) -> None:
    """Replace ``path`` with ``data`` as JSON (indented by one, keys sorted) in one rename."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True), durable=durable)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename) to disk where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: How Rust libraries (tokenizers, safetensors) report an OS error: a plain Exception, ``File too large (os error 27)``.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def disk_full(exc: BaseException) -> bool:
    """Whether exc, or an error it was raised from, is a full disk, a quota or the file-size limit.
    numpy's short write (``N requested and M written``) and a Rust library's error carry no errno."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and (exc.errno in _FULL or ("requested and" in str(exc) and "written" in str(exc))):
            return True
        if any(int(code) in _FULL for code in _RUST_OS_ERROR.findall(str(exc))):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
