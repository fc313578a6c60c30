"""Paths with spaces, quotes and non-ASCII letters work end to end, and every command a
message suggests is accepted when pasted (one process, tiny model)."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.compose import compose
from llmforge.errors import pasteable

runner = CliRunner()
TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.steps=2",
    "logging.console=false",
    "logging.wandb.mode=disabled",
]


@pytest.mark.parametrize("path", ["runs/tiny", "/tmp/my run é", "/tmp/it's here", "/tmp/a,b=c[1]", "/tmp/back\\slash", "/tmp/$HOME x"])
def test_a_pasted_override_reads_back_the_same_path(path):
    assert compose(shlex.split(pasteable("run.dir", path))).run.dir == path
    assert shlex.split(pasteable("ckpt", path, override=False)) == [f"ckpt={path}"]


def test_a_run_in_a_folder_with_spaces_and_accents_resumes_and_its_hint_is_accepted(tmp_path, small_data):
    run_dir = tmp_path / "my run é"
    result = runner.invoke(app, ["pretrain", *TINY, *small_data, pasteable("run.dir", run_dir).strip('"')])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["resume", f"ckpt={run_dir}", "train.steps=3"])  # the saved run.dir is not retyped
    assert result.exit_code == 0, result.output
    again = runner.invoke(app, ["pretrain", *TINY, *small_data, pasteable("run.dir", run_dir).strip('"')])
    assert again.exit_code == 2
    hint = re.search(r"`(llmforge resume [^`]+)`", " ".join(again.output.split())).group(1)
    result = runner.invoke(app, [*shlex.split(hint)[1:], "train.steps=4"])
    assert result.exit_code == 0, result.output
    assert (run_dir / "checkpoints" / "step_4").is_dir()


def test_a_path_of_the_wrong_kind_is_named_as_such(tmp_path):
    (tmp_path / "run").mkdir()
    plan = runner.invoke(app, ["plan", "--json", *TINY])
    (tmp_path / "run" / "plan.json").write_text(plan.stdout, encoding="utf-8")
    assert runner.invoke(app, ["estimate", "--plan", str(tmp_path / "run")]).exit_code == 0  # a run folder: its plan.json
    (tmp_path / "empty").mkdir()
    cases = [
        (["estimate", "--plan", str(tmp_path / "empty")], "is a folder without a plan.json"),
        (["pretrain", f"data.tokenizer={tmp_path / 'empty'}", f"run.dir={tmp_path / 'r'}"], "is a folder, not a file"),
        (["pretrain", f"model.init_from={tmp_path / 'run' / 'plan.json'}", f"run.dir={tmp_path / 'r'}"], "is a file, not a folder"),
    ]
    for args, words in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output
    assert not (tmp_path / "r").exists()
