"""Faults the tests put on a process: a file-size limit that makes writes fail as a full disk does."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes past ``nbytes`` fail with EFBIG (SIGXFSZ ignored) inside the block; the old limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
