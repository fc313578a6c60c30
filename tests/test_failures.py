"""Failures tell the truth: messages print as written, one run per folder, folders
checked before work, and every user mistake ends in one message with exit code 2."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.errors import UserError
from llmforge.rundir import LOCK_NAME, RunLock, check_writable

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def assert_user_error(result, *expected: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    for text in expected:
        assert text in result.output, result.output
    return result.output


def test_brackets_in_values_print_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = assert_user_error(invoke("plan", "recipe=a[/b]"), "a[/b]", "no such recipe option")
    assert "MarkupError" not in out
    assert list(tmp_path.iterdir()) == []


def test_a_locked_run_folder_names_its_holder(tmp_path):
    run_dir = tmp_path / "new" / "run"
    with RunLock(run_dir):
        assert f"pid {os.getpid()}" in (run_dir / LOCK_NAME).read_text()
        with pytest.raises(UserError) as info:
            RunLock(run_dir).acquire()
        assert f"pid {os.getpid()}" in info.value.message() and str(run_dir) in info.value.message()
    assert not (tmp_path / "new").exists()  # the lock created the folders, and nothing else used them


def test_a_file_in_the_way_is_refused_before_work(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError) as info:
        check_writable(tmp_path / "afile" / "run", key="run.dir")
    assert "afile is a file" in info.value.message() and "run.dir" in info.value.message()
    result = invoke("pretrain", f"run.dir={tmp_path / 'afile'}", "train.steps=2")
    assert_user_error(result, "is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
