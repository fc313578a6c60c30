"""Which run owns a ``checkpoint.dir`` in object storage.

A local run folder is owned through its lock and its files; a URL has neither, so the
run that first takes it writes ``owner.json`` there (its ``run.dir``, host and time): at
launch, or at the first save where the launcher does not run on this machine. Every save
checks the record first, so a run whose prefix another took over stops instead of
rotating the newcomer's checkpoints away. Another
run is refused the prefix; ``--overwrite`` deletes what the earlier run left there (its
``step_N``, ``superseded-step_N`` and ``diverged-step_N`` checkpoints and the record), and
nothing else under the prefix.

Every function takes URLs (``str``) and imports no torch.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from pathlib import Path
from typing import Any

from llmforge.checkpoint import objstore
from llmforge.errors import Problem, UserError
from llmforge.storage import basename, join, storage_error

OWNER = "owner.json"
#: The prefixes a run leaves under its checkpoint.dir.
_RUN_PREFIX = re.compile(r"^((superseded|diverged)-)?step_\d+$")


def run_id(run_dir: Path) -> str:
    """How a record names a run: its folder, absolute, links resolved."""
    return os.path.realpath(os.path.expanduser(str(run_dir)))


def _spelled(run_dir: Path) -> str:
    """The folder absolute as written (a node that mounts it through other links still matches)."""
    return os.path.abspath(os.path.expanduser(str(run_dir)))


def read_owner(root: str) -> dict[str, Any] | None:
    """The owner record under ``root``, or None when no run has recorded itself there."""
    url = join(root, OWNER)
    try:
        if not objstore.exists(url):
            return None
        data = objstore.read_json(url)
    except ValueError:
        return {"run_dir": "(unreadable owner.json)"}
    except Exception as exc:  # the backend's own error types
        raise storage_error(exc, url=root, doing="read its owner record") from None
    return data if isinstance(data, dict) else {"run_dir": "(unreadable owner.json)"}


def is_owner(record: dict[str, Any] | None, run_dir: Path) -> bool:
    """Whether ``record`` names the run in ``run_dir``."""
    if record is None:
        return False
    return record.get("run_dir") == run_id(run_dir) or record.get("as_given", record.get("run_dir")) == _spelled(run_dir)


def record_owner(root: str, *, run_dir: Path) -> None:
    """Write (or rewrite) ``root``'s owner record naming the run in ``run_dir``."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {"run_dir": run_id(run_dir), "as_given": _spelled(run_dir), "host": socket.gethostname(), "since": now}
    objstore.write_json(join(root, OWNER), record)


def left_by_runs(root: str) -> list[str]:
    """The checkpoints (complete or not) and set-aside checkpoints under ``root``, as URLs."""
    found = [u for u in objstore.children(root) if _RUN_PREFIX.match(basename(u))]
    return sorted(found, key=lambda u: (basename(u).rsplit("step_", 1)[0], int(basename(u).rsplit("_", 1)[1])))


def clear(root: str) -> list[str]:
    """Delete every checkpoint a run left under ``root`` (each unpublished first) and the owner record."""
    gone = left_by_runs(root)
    for prefix in gone:
        objstore.remove(prefix)
    url = join(root, OWNER)
    if objstore.exists(url):
        objstore.filesystem(url).rm_file(url)
    return gone


def describe(record: dict[str, Any]) -> str:
    """``the run in DIR (on HOST since TIME)``."""
    where = ", ".join(f"{k} {record[k]}" for k in ("host", "since") if record.get(k))
    return f"the run in {record.get('run_dir')}" + (f" ({where})" if where else "")


def check_at_save(root: str, *, run_dir: Path) -> None:
    """Before each save: refuse a prefix another run owns (also one that took it over while this
    run trained), record this run if none does."""
    record = read_owner(root)
    if record is None:
        record_owner(root, run_dir=run_dir)
    elif not is_owner(record, run_dir):
        raise UserError([foreign_problem(root, record)], title="checkpoint.dir belongs to another run")


def foreign_problem(root: str, record: dict[str, Any]) -> Problem:
    """The refusal of a prefix that another run owns."""
    return Problem(
        "checkpoint.dir",
        root,
        f"holds the checkpoints of {describe(record)}: this run's saves would overwrite them and rotate them away",
        f"give this run its own prefix, e.g. checkpoint.dir={free_prefix(root)}; continue that run with "
        f"`llmforge resume ckpt={root}`; or pass --overwrite to delete its checkpoints and start over there",
    )


def free_prefix(root: str) -> str:
    """``ROOT-2`` (or -3, ...): a prefix beside ``root`` that no run has taken."""
    base = root.rstrip("/")
    for n in range(2, 50):
        candidate = f"{base}-{n}"
        if read_owner(candidate) is None and not left_by_runs(candidate):
            return candidate
    return f"{base}-new"
