"""Faults of a running multi-process job: a killed launcher, a killed rank, a stopped
rank, and a second run on the same folder. Each starts a real `llmforge pretrain`
of parallel=dp2 in its own process and injects the fault with a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.rundir import RunLock

pytestmark = pytest.mark.slow


def _start(run_dir: Path, small_data, *extra: str) -> subprocess.Popen:
    args = [*small_data, "parallel=dp2", "train.steps=100000", "train.log_interval=1", "logging=quiet", f"run.dir={run_dir}", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "llmforge", "pretrain", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _wait_for(condition, *, proc: subprocess.Popen, deadline_s: float = 240) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early:\n{proc.stdout.read()}")
        assert time.monotonic() < end, "the run did not get there in time"
        time.sleep(0.2)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of the workers the launcher started."""
    found = {}
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for pid in (task / "children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e for e in env if e.startswith(b"RANK=")]
            if rank:
                found[int(rank[0][5:])] = int(pid)
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def test_second_run_is_refused_and_workers_die_with_their_launcher(tmp_path, small_data):
    run_dir = tmp_path / "run"
    launcher = _start(run_dir, small_data, "checkpoint.interval=2", "checkpoint.keep=1000")
    try:
        _wait_for(lambda: any(run_dir.glob("checkpoints/step_*/manifest.json")), proc=launcher)
        for args in (["pretrain", *small_data, f"run.dir={run_dir}", "train.steps=2"], ["resume", f"ckpt={run_dir}"]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 2, result.output
            assert f"pid {launcher.pid}" in result.output and "Traceback" not in result.output
        workers = _ranks(launcher.pid)
        assert sorted(workers) == [0, 1]
    finally:
        launcher.kill()  # SIGKILL, as the OOM killer would
        launcher.wait()
    end = time.monotonic() + 30
    while not all(_gone(pid) for pid in workers.values()):
        assert time.monotonic() < end, "the ranks outlived their launcher"
        time.sleep(0.2)
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    metrics = _lines(run_dir / "metrics.jsonl")
    time.sleep(2)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == saved
    assert _lines(run_dir / "metrics.jsonl") == metrics
    with RunLock(run_dir):  # the dead launcher's lock went with it
        pass


def _signal_rank_one(run_dir: Path, small_data, sig: signal.Signals, *extra: str) -> tuple[int, str]:
    """Start a dp2 run, send ``sig`` to rank 1 once two steps are logged; the launcher's exit code and output."""
    launcher = _start(run_dir, small_data, *extra)
    try:
        _wait_for(lambda: _lines(run_dir / "metrics.jsonl") >= 2, proc=launcher)
        os.kill(_ranks(launcher.pid)[1], sig)
        output = launcher.communicate(timeout=120)[0]
    finally:
        launcher.kill()
    return launcher.returncode, output


def test_a_killed_rank_ends_the_job_with_its_peers_error_once(tmp_path, small_data):
    code, output = _signal_rank_one(tmp_path / "run", small_data, signal.SIGKILL)
    assert code == 1, output
    assert "rank 1 was killed by SIGKILL" in output
    assert "Traceback" not in output and "MarkupError" not in output
    # rank 0 loses its peer inside a collective: gloo's own words, brackets and all, once
    gloo = [line for line in output.splitlines() if "rank 0 failed" in line]
    assert len(gloo) <= 1
    assert all("[" in line for line in gloo)


def test_a_stopped_rank_is_named_and_ends_the_job(tmp_path, small_data):
    code, output = _signal_rank_one(tmp_path / "run", small_data, signal.SIGSTOP, "cluster.timeout_s=20")
    assert code == 1, output
    assert "rank 1 stopped answering" in output and "Traceback" not in output
