"""A training process prepares a missing data entry in a child process: the tokenizing
libraries (``datasets``, pyarrow, pandas, ``tokenizers``) and their tables stay out of it, so a
CPU rank's peak memory is its run's. A child that fails leaves the error to the caller, which
says it as ``prepare`` does (one message, exit code 2)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from llmforge.config.compose import compose
from llmforge.data.apart import prepare_apart
from llmforge.data.prepare import reusable
from llmforge.errors import UserError

SMALL = "data.builtin_max_mb=0.5"
HEAVY = ("datasets", "pyarrow", "pandas", "tokenizers")

CHILD = """
import sys
from llmforge.config.compose import compose
from llmforge.data.apart import prepare_apart
cfg = compose(["data.builtin_max_mb=0.5", "data.cache_dir=" + sys.argv[1], "logging=quiet"])
prepared = prepare_apart(data=cfg.data, vocab_size=cfg.model.vocab_size, seed=0, console=None)
print(prepared.reused, sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2:])))
"""


def test_a_missing_entry_is_built_in_a_child_and_read_here(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cache"), *HEAVY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "[]"]  # read back from the cache the child wrote; nothing heavy imported here
    cfg = compose([SMALL, f"data.cache_dir={tmp_path / 'cache'}", "logging=quiet"])
    assert reusable(data=cfg.data, vocab_size=cfg.model.vocab_size) is not None


def test_a_child_that_fails_leaves_the_message_to_the_caller(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a fine line"}\n{"text": oops\n')
    cfg = compose(["data=files", f"data.path={bad}", f"data.cache_dir={tmp_path / 'cache'}", "logging=quiet"])
    assert reusable(data=cfg.data, vocab_size=cfg.model.vocab_size) is None
    with pytest.raises(UserError, match="bad.jsonl"):
        prepare_apart(data=cfg.data, vocab_size=cfg.model.vocab_size, seed=0, console=None)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.npy"))


STOPPED = """
import multiprocessing, sys
from llmforge.config.compose import compose
from llmforge.data.apart import prepare_apart
from llmforge.errors import Terminated, end_by_sigterm
cfg = compose(["data.builtin_max_mb=2", "data.vocab_size=300", "data.cache_dir=" + sys.argv[1], "logging=quiet"])
try:
    prepare_apart(data=cfg.data, vocab_size=cfg.model.vocab_size, seed=0, console=None)
except Terminated:  # as llmforge's commands end on it
    print("unwound; children left:", multiprocessing.active_children(), flush=True)
    end_by_sigterm()
"""


def test_sigterm_while_the_child_prepares_stops_the_child_and_unwinds_the_caller(tmp_path):
    caller = subprocess.Popen(
        [sys.executable, "-c", STOPPED, str(tmp_path / "cache")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    prepared = tmp_path / "cache" / "prepared"
    deadline = time.monotonic() + 240
    while not (prepared.exists() and any(".tmp-" in p.name for p in prepared.iterdir())):
        assert caller.poll() is None and time.monotonic() < deadline, caller.communicate()
        time.sleep(0.02)
    caller.send_signal(signal.SIGTERM)  # to the caller alone, as `kill PID` sends it
    out, err = caller.communicate(timeout=120)
    assert caller.returncode == -signal.SIGTERM, err
    assert out.strip() == "unwound; children left: []"  # no orphan goes on tokenizing
    assert err.count("stopped by SIGTERM while preparing") == 1 and "Traceback" not in err
    assert [p.name for p in prepared.iterdir() if ".tmp-" in p.name] == []  # the child removed its temporary folder
