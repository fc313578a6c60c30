"""One calibration at a time on a machine, from its first timing to its profile written.

Two calibrations at once measure each other (each saw under half the machine) and the
second to finish overwrites the first's profile. ``calibration_lock`` is an advisory
``flock`` on a file in the system's temporary folder, shared by every user's calibrations
on the machine (a lock held on a read-only descriptor is still a lock, so another user's
lock file serves); the lock ends with its process, so a killed calibration never leaves
it held. A calibration that finds it held says so and waits.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from llmforge.errors import UserError

LOCK_NAME = "llmforge-calibrate.lock"
#: How long a calibration waits for another before giving up.
WAIT_S = 900.0


def lock_path() -> Path:
    return Path(tempfile.gettempdir()) / LOCK_NAME


def _open(path: Path) -> int | None:
    """A descriptor to lock: the existing file (whoever made it), else a new one readable by all."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o644)
        return fd
    except OSError:
        return None


@contextlib.contextmanager
def calibration_lock(
    *, say: Callable[[str], None], path: Path | None = None, wait_s: float = WAIT_S, poll_s: float = 0.5
) -> Iterator[bool]:
    """Hold the machine's calibration lock (True), or go on without one where no lock file can
    be made (False, said once); UserError after ``wait_s`` of another calibration holding it."""
    import fcntl

    path = path or lock_path()
    fd = _open(path)
    if fd is None:
        say(f"could not open the calibration lock {path}: another calibration running now would disturb this one")
        yield False
        return
    try:
        if not _try_lock(fd, fcntl):
            say(
                f"another llmforge calibration is measuring this machine (it holds {path}); waiting for it, "
                "since two at once measure each other"
            )
            deadline = time.monotonic() + wait_s
            while not _try_lock(fd, fcntl):
                if time.monotonic() > deadline:
                    raise UserError(
                        f"another llmforge calibration has held {path} for over {wait_s:.0f}s; let it finish or stop it, then calibrate "
                        "again",
                        title="cannot calibrate now",
                    )
                time.sleep(poll_s)
        yield True
    finally:
        os.close(fd)


def _try_lock(fd: int, fcntl) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
