"""The run folder: one run at a time, folders checked writable before any work, and
the one writer of its ``plan.json``.

``RunLock`` holds an exclusive ``fcntl.flock`` on ``run.dir/.llmforge.lock`` for the
run's lifetime. The kernel drops it when the holder exits, however it exits (the
lock is never inherited by the ranks, so a dead launcher frees the folder), and the
file names the holder's pid and host for the message a second run gets.

This module imports no torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from llmforge.errors import Problem, UserError, fail
from llmforge.files import write_text_atomic

if TYPE_CHECKING:
    from llmforge.plan import RunPlan

LOCK_NAME = ".llmforge.lock"
PLAN_NAME = "plan.json"

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked
    fcntl = None  # type: ignore[assignment]


class RunLock:
    """An exclusive lock on a run folder (a context manager; ``acquire`` raises a
    UserError naming the holder when another run has the folder)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: Path | None = None

    def acquire(self) -> RunLock:
        if fcntl is None or self._fd is not None:
            return self
        self._created = _first_missing(self.run_dir)
        check_writable(self.run_dir, key="run.dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read(fd)
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise fail(
                    f"run.dir={self.run_dir} is in use by another llmforge run ({holder or 'pid unknown'}); "
                    "wait for it to end, stop it, or choose another run.dir=...",
                    title="run folder in use",
                ) from None
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break  # the file we locked is still the lock file (not one its holder just removed)
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock, remove the lock file, and the run folder if the run left it empty."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
        created, self._created = self._created, None
        if created is not None:
            folder = self.run_dir
            while folder != created.parent:  # only what this lock created, and only if empty
                try:
                    folder.rmdir()
                except OSError:
                    break
                folder = folder.parent

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    return ""


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (None if it does)."""
    missing = None
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        missing = folder
    return missing


def check_writable(path: Path, *, key: str, given: Path | None = None) -> None:
    """Refuse a folder that cannot be created or written (a file in the way, no
    permission, a read-only file system) before any work starts; nothing is left behind.
    ``given``: what the user named, when ``path`` is the folder it goes in."""
    path = Path(path).expanduser()
    shown = str(given if given is not None else path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(
            [Problem(key, shown, f"{existing} is a file, not a folder", f"remove the file or choose another {key}")],
            title="cannot write the output",
        )
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".llmforge-probe-"):
            pass
    except OSError as exc:
        raise UserError(
            [
                Problem(
                    key,
                    shown,
                    f"cannot write in {existing} ({exc.strerror or exc})",
                    f"choose a {key} on a writable file system, or fix the folder's permissions",
                )
            ],
            title="cannot write the output",
        ) from None


def plan_path(plan: RunPlan) -> Path:
    """Where the run's plan.json lives (absolute: the ranks may start elsewhere)."""
    return (plan.run_dir / PLAN_NAME).resolve()


def write_plan(plan: RunPlan) -> Path:
    """Write the run's plan.json atomically (what the ranks, ``resume`` and
    ``estimate --plan`` read back); returns its path."""
    path = plan_path(plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, plan.to_json())
    return path


# What a run writes in its folder: no output command may replace one of them.
RUN_FILE_NAMES = (
    PLAN_NAME,
    "metrics.jsonl",
    "events.log",
    "checkpoints",
    LOCK_NAME,
    "wandb_run_id",
    "launch.sbatch",
    "profile",
    "tensorboard",
)
_MANIFEST = "manifest.json"  # llmforge.checkpoint.manifest.MANIFEST (that module is not imported here)


def refuse_run_outputs(path: Path, *, key: str, example: str) -> None:
    """Refuse an output inside a run's checkpoints (a checkpoint that gains files is taken as
    damaged by the next resume, which then trains its steps again) or over one of its run files.
    ``example``: a name in the run folder to suggest instead."""
    target = Path(os.path.realpath(Path(path).expanduser()))
    for folder in [target, *target.parents]:
        if _is_checkpoint_folder(folder):
            run = folder.parent if folder.name == "checkpoints" else _run_of(folder)
            raise UserError(
                [
                    Problem(
                        key,
                        str(path),
                        f"is inside the checkpoints of the run in {run}, which only training may write",
                        f"choose a {key} outside {run / 'checkpoints'}, e.g. {run / example}",
                    )
                ],
                title="cannot write the output",
            )
    if (target.parent / PLAN_NAME).is_file() and target.name in RUN_FILE_NAMES:
        raise UserError(
            [
                Problem(
                    key,
                    str(path),
                    f"is the run's own {target.name} in {target.parent}",
                    f"choose a {key} that is not one of the run's files, e.g. {target.parent / example}",
                )
            ],
            title="cannot write the output",
        )


def _is_checkpoint_folder(folder: Path) -> bool:
    """A step folder (it has a manifest) or a run's ``checkpoints`` folder."""
    if (folder / _MANIFEST).is_file():
        return True
    return folder.name == "checkpoints" and ((folder.parent / PLAN_NAME).is_file() or any(folder.glob(f"step_*/{_MANIFEST}")))


def _run_of(step_dir: Path) -> Path:
    root = step_dir.parent
    return root.parent if root.name == "checkpoints" else root
