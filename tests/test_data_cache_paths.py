"""A data cache that cannot be written ends in one message naming data.cache_dir and the fix
(exit 2, no traceback): a file in the way, a folder where the lock file goes, a read-only
folder. A prepared cache is read without its lock, so a read-only one shared by many
users still serves every run."""

from __future__ import annotations

import errno
import os
import shutil

from typer.testing import CliRunner

import llmforge.data.cache as cache
from llmforge.cli import app

runner = CliRunner()
SMALL = "data.builtin_max_mb=0.5"


def prepare(cache_dir) -> str:
    result = runner.invoke(app, ["data", "prepare", SMALL, f"data.cache_dir={cache_dir}"])
    return result


def refused(result, *words: str) -> str:
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert all(w in text for w in words), text
    return text


class ReadOnlyLock:
    """What FileLock meets on a read-only file system; counts the tries."""

    tries = 0

    def __init__(self, path: str) -> None:
        self.path = path

    def acquire(self) -> None:
        ReadOnlyLock.tries += 1
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), self.path)


def test_a_cache_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "cache").write_text("not a folder")
    refused(prepare(tmp_path / "cache"), "data.cache_dir", f"{tmp_path / 'cache'} is a file", "Fix:")
    refused(prepare(tmp_path / "cache" / "below"), f"{tmp_path / 'cache'} is a file")


def test_a_folder_where_the_lock_goes_is_named(tmp_path, data_cache):
    prepared = next((data_cache / "prepared").glob("builtin-*"), None) if (data_cache / "prepared").is_dir() else None
    if prepared is None:
        assert prepare(data_cache).exit_code == 0
        prepared = next((data_cache / "prepared").glob("builtin-*"))
    (tmp_path / "prepared" / f".{prepared.name}.lock").mkdir(parents=True)
    refused(prepare(tmp_path), "data.cache_dir", "is taken by a folder", "remove that folder")


def test_a_read_only_prepared_cache_is_read_without_its_lock(tmp_path, data_cache, monkeypatch):
    assert prepare(data_cache).exit_code == 0
    shared = tmp_path / "shared"
    shutil.copytree(data_cache, shared, ignore=shutil.ignore_patterns("*.lock"))
    monkeypatch.setattr(cache, "FileLock", ReadOnlyLock)
    ReadOnlyLock.tries = 0
    result = prepare(shared)
    assert result.exit_code == 0 and "reused cache" in result.output, result.output
    assert ReadOnlyLock.tries == 0
    assert not list((shared / "prepared").glob("*.lock"))


def test_a_read_only_empty_cache_says_how_to_get_it_prepared(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "FileLock", ReadOnlyLock)
    refused(prepare(tmp_path / "empty"), "data.cache_dir", "Read-only file system", "llmforge data prepare")
