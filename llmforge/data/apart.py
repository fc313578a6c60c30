"""Data preparation in a child process of its own, for a process that trains next.

Tokenizing imports ``datasets`` (pyarrow, pandas) and ``tokenizers`` and builds their tables:
about 0.24 GiB of resident memory on the built-in corpus that stays with the process after the
shards are written, and would sit in a CPU rank's peak memory through the whole run. A training
process prepares a missing cache entry in a spawned child, then reads the entry it wrote.

A child that fails (bad data, a tokenizer that refuses the vocabulary) leaves nothing behind
(``llmforge.data.cache`` stages every entry); the caller then prepares in its own process, which
raises the same error with its message. SIGTERM or Ctrl-C to the caller while it waits stops the
child first (its preparation removes its temporary folder and says so), then unwinds the caller.
"""

from __future__ import annotations

import multiprocessing

from rich.console import Console

from llmforge.config.schema import DataConfig
from llmforge.data.cache import sigterm_unwinds
from llmforge.data.prepare import PreparedData, prepare, reusable
from llmforge.errors import UserError


def prepare_apart(*, data: DataConfig, vocab_size: int, seed: int, console: Console | None) -> PreparedData:
    """``prepare``, the building (if the entry is missing or stale) in a spawned child."""
    try:
        ready = reusable(data=data, vocab_size=vocab_size)
    except UserError:  # wrong inputs: prepare says why, here
        return prepare(data=data, vocab_size=vocab_size, seed=seed, console=console)
    if ready is not None:
        return ready
    child = multiprocessing.get_context("spawn").Process(
        target=_prepare, kwargs={"data": data, "vocab_size": vocab_size, "seed": seed, "show": _show(console)}, daemon=True
    )
    child.start()
    try:
        with sigterm_unwinds():
            child.join()
    except BaseException:  # SIGTERM or Ctrl-C: the child stops too and removes what it half-wrote
        _stop(child)
        raise
    return prepare(data=data, vocab_size=vocab_size, seed=seed, console=console)


def _stop(child) -> None:
    """SIGTERM to the child (its preparation removes its temporary folder and says so), SIGKILL if it lingers."""
    if child.is_alive():
        child.terminate()
        child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join()


def _show(console: Console | None) -> str | None:
    """Where the child prints its progress: the caller's stream ("stdout", "stderr"), None: nowhere."""
    if console is None or console.quiet:
        return None
    return "stderr" if console.stderr else "stdout"


def _prepare(*, data: DataConfig, vocab_size: int, seed: int, show: str | None) -> None:
    console = Console(stderr=show == "stderr", markup=False, soft_wrap=True) if show else None
    try:
        prepare(data=data, vocab_size=vocab_size, seed=seed, console=console)
    except UserError:
        raise SystemExit(2) from None  # the parent prepares again and says why
