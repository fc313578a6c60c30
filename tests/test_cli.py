"""The command line: help pages, plan/recipes/keys output, and user mistakes (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from llmforge.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize("command", ["pretrain", "resume", "plan", "recipes", "estimate", "keys", "export"])
def test_help_pages_have_examples(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output and "llmforge" in result.output


def test_top_level_help_lists_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("pretrain", "resume", "plan", "recipes", "estimate"):
        assert command in result.output


def test_plan_json():
    result = invoke("plan", "recipe=gpt-1b", "parallel=tp4pp2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["derived"]["world_size"] == 8 and data["config"]["parallel"]["tp"] == 4


def test_plan_table():
    result = invoke("plan", "recipe=gpt-7b")
    assert result.exit_code == 0
    assert "dp 4 x tp 4 x pp 2" in result.output


def test_recipes_lists_groups_with_descriptions():
    result = invoke("recipes")
    assert result.exit_code == 0
    for name in ("tiny", "gpt-125m", "gpt-1b", "gpt-7b", "tp4pp2", "bf16", "llama-8b", "mixtral-8x7b"):
        assert name in result.output
    assert "built-in corpus" in result.output


def test_keys_lists_fixed_names_with_help():
    result = invoke("keys", "parallel.")
    assert result.exit_code == 0
    assert "parallel.pp_schedule" in result.output and "model.hidden_size" not in result.output


USER_MISTAKES = [
    ("plan", "recipe=nope"),
    ("plan", "parallel=tp3"),
    ("plan", "model.hiden_size=64"),
    ("plan", "train.steps=ten"),
    ("plan", "parallel.tp=3"),
    ("plan", "notanoverride"),
    ("plan", "--config-dir", "/does/not/exist"),
    ("estimate", "parallel.pp=3"),
    ("pretrain", "parallel.tp=3"),
    ("resume", "ckpt=/does/not/exist"),
    ("pretrain", "recipe=gpt-1b", "cluster.devices_per_node=64"),  # more GPUs than any one machine has
]


@pytest.mark.parametrize("args", USER_MISTAKES, ids=[" ".join(a) for a in USER_MISTAKES])
def test_user_mistakes_exit_2_without_traceback(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "error" in result.output.lower()
    assert list(tmp_path.iterdir()) == []  # nothing written


LIGHT_COMMANDS = [
    ["--help"],
    ["recipes"],
    ["plan", "recipe=gpt-1b", "parallel=tp4pp2"],
    ["keys"],
    ["estimate", "recipe=gpt-7b", "parallel=tp4pp2"],
]


@pytest.mark.parametrize("argv", LIGHT_COMMANDS, ids=[" ".join(a) for a in LIGHT_COMMANDS])
def test_light_commands_import_no_torch(argv):
    code = (
        "import sys; from llmforge.cli import app\n"
        f"try:\n    app({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'datasets', 'wandb', 'tokenizers') if m in sys.modules]\n"
        "print('HEAVY', heavy, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in proc.stderr, proc.stderr[-2000:]


def test_console_script_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "llmforge", "plan", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["config"]["recipe"] == "tiny"
