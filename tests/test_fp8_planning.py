"""Planning and estimating an FP8 run need no torchao; launching one (pretrain, resume) does.

torchao is hidden from the import system for each test, whether or not it is installed."""

from __future__ import annotations

import importlib.abc
import json
import sys

import pytest
from typer.testing import CliRunner

from llmforge.cli import app

runner = CliRunner()
EMULATED = ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_linears=all"]
GPU_FP8 = ["recipe=gpt-1b", "precision=fp8", "train.compile=true"]


class _NoTorchao(importlib.abc.MetaPathFinder):
    """An environment where torchao is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchao" or name.startswith("torchao."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


@pytest.fixture
def no_torchao(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [_NoTorchao(), *sys.meta_path])
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("command", [["plan"], ["estimate"], ["estimate", "cluster=h100-node"]])
def test_plan_and_estimate_of_fp8_work_without_torchao(no_torchao, command):
    result = runner.invoke(app, [*command, *GPU_FP8])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if "launching will need it" in line]
    assert len(notes) == 1 and "torchao" in notes[0] and "llmforge[fp8]" in notes[0]


def test_estimate_json_of_fp8_stays_json_without_torchao(no_torchao):
    result = runner.invoke(app, ["estimate", *GPU_FP8, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["schema"].startswith("llmforge.estimate")
    assert "launching will need it" in result.stderr


def test_estimate_measure_of_fp8_is_refused_without_torchao(no_torchao):
    result = runner.invoke(app, ["estimate", *EMULATED, "--measure"])
    assert result.exit_code == 2 and "torchao" in result.output and "Traceback" not in result.output


def test_fp8_without_torchao_is_refused_before_launch(no_torchao, tmp_path):
    result = runner.invoke(app, ["pretrain", *EMULATED, f"run.dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert "torchao" in result.output and "llmforge[fp8]" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_resume_into_fp8_without_torchao_is_refused(no_torchao, tmp_path, small_data):
    run_dir = tmp_path / "run"
    common = [
        "model.seq_len=32",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "logging.console=false",
        "logging.wandb.mode=disabled",
    ]
    first = runner.invoke(app, ["pretrain", *small_data, *common, "train.steps=1", "data.val_fraction=0", f"run.dir={run_dir}"])
    assert first.exit_code == 0, first.output
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    result = runner.invoke(app, ["resume", f"ckpt={run_dir}", *EMULATED, "train.steps=2"])
    assert result.exit_code == 2, result.output
    assert "torchao" in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
