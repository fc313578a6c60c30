"""Why a save failed, in words a user can act on: the OSError inside DCP's wrapper, the
file-size limit torch reports only as "unexpected pos", the free space."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path


def os_error(exc: BaseException) -> BaseException:
    """The OSError inside DCP's CheckpointException (it wraps each rank's failure), else
    the first rank's own exception."""
    if isinstance(exc, OSError):
        return exc
    inner = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]  # (exception, stack) per rank
    return next((e for e in inner if isinstance(e, OSError)), inner[0] if inner else exc)


def interruption(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt (a second Ctrl-C), SystemExit or SIGTERM's unwinding that ended a save,
    which DCP reports as a rank's failure inside its CheckpointException; None for any other failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if not isinstance(current, (Exception, CheckpointException)):
            return current
        todo += [f[0] if isinstance(f, tuple) else f for f in getattr(current, "failures", {}).values()]
        todo += [current.__cause__, current.__context__]
    return None


def save_failure(exc: BaseException, *, root: Path) -> tuple[str, str]:
    """(what went wrong, what to do) for a save into ``root`` that failed. torch's writer
    reports a short write as "unexpected pos", so the limits of this process and file
    system are named too."""
    import errno

    cause = os_error(exc)
    if isinstance(cause, OSError):
        why = f"{cause.filename + ': ' if cause.filename else ''}{cause.strerror or cause}"
    else:
        why = f"{type(cause).__name__}: {first_line(cause)}"  # type: ignore[arg-type]
        why = f"a write was cut short ({why})" if "unexpected pos" in why else why
    limit = _file_size_limit()
    if limit is not None:
        return (
            f"{why} (files written here may be at most {limit:,} bytes: the file-size limit, `ulimit -f`)",
            "raise the file-size limit (`ulimit -f unlimited`)",
        )
    if isinstance(cause, OSError) and cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return why, f"make {root} writable"
    with contextlib.suppress(OSError):
        why += f" ({shutil.disk_usage(root).free / 2**30:.2f} GiB free on its file system)"
    return why, f"free space on the file system of {root}"


def _file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``), or None when unlimited."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
