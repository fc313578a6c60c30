"""LLMFORGE_FAULT is checked before anything is written: a malformed one is refused (exit 2,
no run folder), and one whose rank or step never comes, or that ends the command itself,
is said at start-up (a drill that tests nothing must not look passed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.compose import compose
from llmforge.launch.checks import check_fault
from llmforge.plan import RunPlan

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
    "train.steps=4",
    "logging.console=false",
    "logging.wandb.mode=disabled",
]


@pytest.mark.parametrize("spec", ["abc", "0:5-3:nan-loss", "0:3:garbage", ":", "0:0", "x:3", "0:3:exit:1"])
def test_a_malformed_fault_is_refused_before_anything_is_written(monkeypatch, tmp_path, small_data, spec):
    monkeypatch.setenv("LLMFORGE_FAULT", spec)
    result = runner.invoke(app, ["pretrain", *TINY, *small_data, f"run.dir={tmp_path / 'run'}"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "LLMFORGE_FAULT" in result.output and "RANK:STEP" in result.output
    assert not (tmp_path / "run").exists()


def said(spec: str, monkeypatch, *, overrides=(), resume_from=None, here=False) -> str:
    monkeypatch.setenv("LLMFORGE_FAULT", spec)
    console = Console(record=True, width=300)
    check_fault(RunPlan.build(compose([*TINY, *overrides])), resume_from=resume_from, here=here, console=console)
    return console.export_text()


def test_a_fault_that_never_comes_is_said_at_start_up(monkeypatch):
    assert "rank 2 does not exist" in said("2:2", monkeypatch, overrides=["parallel=dp2", "train.global_batch_size=4"])
    assert "step 9 comes after the last step (4)" in said("0:9:nan-loss", monkeypatch)
    assert "came before this resume from step 3" in said("0:2", monkeypatch, resume_from=Path("runs/x/checkpoints/step_3"))
    assert "tests nothing" in said("0:1-3:nan-grad", monkeypatch, resume_from=Path("runs/x/checkpoints/step_3"))
    assert said("1:2", monkeypatch, overrides=["parallel=dp2", "train.global_batch_size=4"]) == ""
    assert said("0:2-4:nan-loss", monkeypatch, resume_from=Path("runs/x/checkpoints/step_3")) == ""


def test_an_exit_fault_on_a_run_in_this_process_says_it_ends_the_command(monkeypatch):
    assert "this command itself ends after step 2 with exit code 1" in said("0:2", monkeypatch, here=True)
    assert said("0:2:nan-loss", monkeypatch, here=True) == ""


def test_the_closing_line_counts_the_skipped_steps(monkeypatch, tmp_path, small_data):
    monkeypatch.setenv("LLMFORGE_FAULT", "0:2:nan-loss")
    result = runner.invoke(app, ["pretrain", *TINY, *small_data, f"run.dir={tmp_path / 'run'}", "train.anomaly=skip"])
    assert result.exit_code == 0, result.output
    closing = " ".join(result.output.split()).split("done ")[-1]
    assert "1 step(s) skipped on non-finite numbers" in closing, closing
    monkeypatch.delenv("LLMFORGE_FAULT")
    clean = runner.invoke(app, ["pretrain", *TINY, *small_data, f"run.dir={tmp_path / 'clean'}"])
    assert clean.exit_code == 0 and "skipped" not in clean.output.split("done ")[-1]
