"""What every rank runs under: an error on the rank becomes one record and an immediate exit,
and a rank that finished ends without finalizing the interpreter (``end_rank``).

An error is written to ``$LLMFORGE_ERROR_DIR/rank<N>.json`` (the launcher,
``llmforge.processes.torchrun``, shows the first one, once) or, without that variable,
printed; the rank then exits at once with code 2 for a user error and 1 otherwise, and
torchrun stops the other ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from llmforge.errors import UserError
from llmforge.processes.watch import ERROR_DIR_ENV


def env_rank() -> int:
    """This rank, as torchrun set it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def attempt() -> int:
    """How many times torchrun has restarted the ranks of this job (cluster.max_restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


@contextlib.contextmanager
def report_errors() -> Iterator[None]:
    """Turn any exception on this rank into one error record and an immediate exit."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - every failure must end the rank
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        user = isinstance(exc, UserError)
        record = {
            "rank": env_rank(),
            "attempt": attempt(),
            "time": time.time(),
            "kind": "user" if user else "error",
            "message": exc.message() if user else describe_exception(exc),
            "traceback": "" if user else "".join(traceback.format_exception(exc)),
        }
        folder = os.environ.get(ERROR_DIR_ENV)
        if folder:
            path = Path(folder) / f"rank{env_rank()}.json"
            path.write_text(json.dumps(record))
        else:
            print(f"rank {env_rank()}: {record['traceback'] or record['message']}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(2 if user else 1)


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` and where it was raised: the launcher's one-paragraph account
    of an unexpected error (the whole traceback shows with LLMFORGE_TRACEBACK=1)."""
    text = "".join(traceback.format_exception_only(exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f"{os.sep}llmforge{os.sep}" in f.filename and not f.filename.endswith(("worker.py", "harness.py"))]
    frame = (ours or frames or [None])[-1]
    return f"{text}\n  (in {frame.name}, {frame.filename}:{frame.lineno})" if frame else text


def end_rank() -> NoReturn:
    """End a rank that finished (its process groups destroyed) with exit code 0: other threads
    joined, exit handlers run, output flushed, then ``os._exit``, without finalizing the interpreter.

    ``destroy_process_group`` does not end gloo's threads while anything still holds a group:
    DTensor's sharding and redistribution caches keep every device mesh (and so its groups),
    and a parameter's gradient hook keeps the group it reduces over. Those threads would run on
    while the interpreter finalizes, and a gloo thread that needs the GIL then (to release the
    Python object of a tensor its last collective held) is ended by the interpreter inside a C++
    destructor: ``std::terminate``, "terminate called without an active exception", SIGABRT after a
    run that succeeded. With no finalization there is nothing left for such a thread to race."""
    threading._shutdown()  # type: ignore[attr-defined]  # what finalization runs first: joins non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
