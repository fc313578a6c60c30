"""Failures tell the truth: messages print as written, one run per folder, folders
checked before work, and every user mistake ends in one message with exit code 2."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.errors import UserError
from llmforge.rundir import LOCK_NAME, RunLock, check_writable
from llmforge.testing.faults import file_size_limit

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


# -- configuration mistakes: one message naming the key or file and the fix --------------------

MISTAKES = [
    (["=5"], "an override needs a key before '='"),
    (["train.steps==3"], "write train.steps=3"),
    (["run.dir=x[/y]"], "run.dir='...'"),
    (["train.steps=1,2"], "a sweep"),
    (["model.vocab_size=200"], None),  # plan accepts it; pretrain refuses it (below)
]


@pytest.mark.parametrize("args,expected", [m for m in MISTAKES if m[1]], ids=[m[0][0] for m in MISTAKES if m[1]])
def test_override_mistakes_are_explained(args, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = assert_user_error(invoke("plan", *args), expected)
    assert "config:" not in out and "None" not in out
    assert list(tmp_path.iterdir()) == []


def test_vocab_too_small_names_the_key_that_set_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = assert_user_error(invoke("pretrain", "model.vocab_size=200"), "model.vocab_size = 200", "at least 257")
    assert "data.vocab_size" not in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name,text,expected",
    [
        ("empty", "", "is empty"),
        ("listed", "- a\n- b\n", "holds a YAML list"),
        ("missing", "# @package _global_\ndefaults:\n  - override /model: nope\n", "no such model option"),
    ],
)
def test_broken_recipe_files_are_named(name, text, expected, tmp_path, monkeypatch):
    (tmp_path / "cfg" / "recipe").mkdir(parents=True)
    (tmp_path / "cfg" / "recipe" / f"{name}.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    out = assert_user_error(invoke("plan", "-C", str(tmp_path / "cfg"), f"recipe={name}"), expected, f"{name}.yaml")
    assert "DictConfig" not in out and "search path" not in out.lower()


def test_single_message_errors_have_one_title(tmp_path):
    out = assert_user_error(invoke("resume", f"ckpt={tmp_path / 'nope'}"))
    assert "error: error" not in out and "(1 problem)" not in out


def test_keys_shows_the_default_runs_values():
    result = invoke("keys", "train.steps")
    assert result.exit_code == 0
    assert " 300 " in result.output  # the default recipe's, not the schema's 100


def test_dry_run_says_it_wrote_no_plan(tmp_path):
    result = invoke("pretrain", "parallel=dp2", f"run.dir={tmp_path / 'run'}", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "--dry-run writes nothing" in result.output and "llmforge plan" in result.output
    assert not (tmp_path / "run").exists()


def test_default_cadence_loses_at_most_a_tenth(tmp_path):
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    assert RunPlan.build(compose([])).checkpoint_interval == 30  # the 300-step default run
    assert RunPlan.build(compose(["train.steps=100000"])).checkpoint_interval == 10000
    assert RunPlan.build(compose(["train.steps=8"])).checkpoint_interval == 10  # short runs: at the end
    assert RunPlan.build(compose(["checkpoint.interval=0"])).checkpoint_interval == 0


# -- checkpoints: the manifest must account for every file; a refused save loses nothing ---------


@pytest.fixture
def checkpoint(tmp_path):
    from test_checkpoint_store import save, saver, tiny

    model, optimizer = tiny()
    s = saver(tmp_path / "checkpoints", keep=3)
    save(s, model, optimizer, 1)
    return s, model, optimizer, save(s, model, optimizer, 2)


def _damage(folder, how: str) -> None:
    import json

    manifest = folder / "manifest.json"
    data = json.loads(manifest.read_text())
    if how == "empty list":
        data["files"] = {}
    elif how == "step":
        data["step"] = 7
    elif how == "extra file":
        (folder / "extra.bin").write_bytes(b"x")
        return
    elif how == "train state":
        path = folder / "train_state.json"
        path.write_text("{not json" + " " * (path.stat().st_size - 9))  # same size: only the checksum can tell
        data["files"]["train_state.json"]["sha256"] = __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "how,named",
    [
        ("empty list", ".metadata"),
        ("step", "records step 7"),
        ("extra file", "extra.bin"),
        ("train state", "train_state.json"),
    ],
)
def test_a_checkpoint_the_manifest_does_not_account_for_is_damaged(checkpoint, how, named):
    from llmforge.checkpoint.locate import locate

    *_, folder = checkpoint
    _damage(folder, how)
    with pytest.raises(UserError) as info:
        locate(str(folder))
    assert named in info.value.message() and "damaged checkpoint" in info.value.message()
    assert locate(str(folder.parent)).path.name == "step_1"  # `latest` falls back past it
    result = invoke("resume", f"ckpt={folder}")
    assert_user_error(result, named)


def test_a_refused_save_removes_its_folder_and_keeps_latest(checkpoint):
    from test_checkpoint_store import save

    from llmforge.checkpoint.locate import locate

    s, model, optimizer, folder = checkpoint
    with file_size_limit(4096), pytest.raises(UserError) as info:  # files past 4 KiB fail, as on a full disk
        save(s, model, optimizer, 3)
    message = info.value.message()
    assert "step 3" in message and str(folder.parent) in message and str(folder) in message
    assert sorted(p.name for p in folder.parent.iterdir()) == ["step_1", "step_2"]
    assert locate(str(folder.parent)).path == folder


def test_export_to_a_file_is_refused_before_reading(tmp_path):
    (tmp_path / "out").write_text("x")
    result = invoke("export", f"ckpt={tmp_path / 'nope'}", "--out", str(tmp_path / "out"))
    assert_user_error(result, "--out", "is a file")
