"""What a new user meets: validation by default, a quiet run whose lines are never
broken, MFU marked approximate against a guessed peak, and clear usage errors."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.compose import compose
from llmforge.estimate.core import estimate_plan
from llmforge.observe.metrics import read_metrics
from llmforge.plan import RunPlan
from llmforge.train.meter import meter_for

runner = CliRunner()
TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.eval_steps=2",
    "logging.wandb.mode=disabled",
]


def pretrain(*args: str):
    result = runner.invoke(app, ["pretrain", *TINY, *args])
    assert result.exit_code == 0, result.output
    return result


def closing_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("done"))


def test_validation_is_on_by_default_and_eval_interval_needs_no_other_key():
    assert RunPlan.build(compose([])).config.data.val_fraction > 0
    assert RunPlan.build(compose(["train.eval_interval=6"])).config.train.eval_interval == 6


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, small_data):
    """A run with the default validation and checkpoint settings, evaluating every 3 steps."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    result = pretrain(
        *small_data, "train.steps=6", "train.eval_interval=3", "checkpoint.interval=2", "checkpoint.keep=1", f"run.dir={run_dir}"
    )
    return run_dir, result.output


def test_default_run_evaluates_every_interval_and_at_the_end(default_run):
    run_dir, output = default_run
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert f"val_loss {records[-1]['val_loss']:.4f}" in closing_line(output)


def test_default_run_keeps_checkpoint_news_in_the_progress_line_and_events_log(default_run):
    run_dir, output = default_run
    assert "training stalled" not in output and "removed old checkpoint" not in output
    progress = [line for line in output.splitlines() if line.startswith("step 6/6")]
    assert len(progress) == 1 and "ckpt 6 (" in progress[0]
    events = (run_dir / "events.log").read_text().splitlines()
    assert sum("checkpoint step" in e and "training stalled" in e for e in events) == 3
    assert sum("removed old checkpoint" in e for e in events) == 2


def test_default_run_prints_whole_lines_and_marks_cpu_mfu_approximate(default_run):
    run_dir, output = default_run
    line = closing_line(output)
    assert str(run_dir / "metrics.jsonl") in line and "measured/estimate:" in line and "peak memory" in line
    assert " MFU ~" in next(line for line in output.splitlines() if line.startswith("step 6/6"))


def test_val_fraction_zero_switches_validation_off(tmp_path, small_data):
    result = pretrain(*small_data, "train.steps=2", "data.val_fraction=0", f"run.dir={tmp_path / 'run'}")
    assert not any("val_loss" in r for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert "val_loss" not in closing_line(result.output)


def test_a_corpus_too_small_to_hold_out_trains_without_validation(tmp_path):
    text = tmp_path / "one.txt"
    text.write_text("def main():\n    return 42\n" * 400)
    result = pretrain(
        "data=files",
        f"data.path={text}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.vocab_size=300",
        "train.steps=2",
        f"run.dir={tmp_path / 'run'}",
    )
    notes = [line for line in result.output.splitlines() if line.startswith("no validation")]
    assert len(notes) == 1 and "data.val_fraction" in notes[0]
    assert "val_loss" not in closing_line(result.output)


def test_a_measured_profile_drops_the_approximate_marker(tmp_path):
    profile = tmp_path / "cpu-measured.yaml"
    profile.write_text(
        "name: cpu-measured\nmemory_gib: 16\npeak_tflops: {fp32: 0.2, tf32: 0.2, bf16: 0.1, fp16: 0.05}\n"
        "memory_bandwidth_gbs: 20\nintra_node_gbs: 5\ninter_node_gbs: 1.25\ndevices_per_node: 64\n"
    )
    import torch

    assert meter_for(estimate_plan(RunPlan.build(compose([]))), device=torch.device("cpu")).peak_approximate
    assert not meter_for(
        estimate_plan(RunPlan.build(compose([f"cluster.accelerator={profile}"]))), device=torch.device("cpu")
    ).peak_approximate


def test_config_path_that_is_a_file_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFORGE_CONFIG_PATH", str(tmp_path / "file.yaml"))
    (tmp_path / "file.yaml").write_text("x: 1\n")
    result = runner.invoke(app, ["plan"])
    assert result.exit_code == 2 and "LLMFORGE_CONFIG_PATH" in result.output and "--config-dir" not in result.output


def test_search_top_below_one_is_a_usage_error():
    result = runner.invoke(app, ["estimate", "--search", "--top", "0"])
    assert result.exit_code == 2 and "--top" in result.output and "fit" not in result.output


def test_step_time_after_a_validation_leaves_the_validation_out(monkeypatch):
    """A fake clock: each training step takes 1 s, each validation batch 100 s."""
    import dataclasses

    import torch

    from llmforge.testing.harness import SyntheticSampler, tiny_plan
    from llmforge.train import loop
    from llmforge.train.build import build_components
    from llmforge.train.callbacks import Recorder
    from llmforge.train.components import RankInfo

    plan = tiny_plan(["train.steps=4"])
    cfg = plan.config

    def synthetic(seed: int) -> SyntheticSampler:
        return SyntheticSampler(
            vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len, global_batch_size=cfg.train.global_batch_size, seed=seed
        )

    torch.manual_seed(cfg.train.seed)
    c = build_components(plan, rank=RankInfo(), sampler=synthetic(cfg.train.seed), val_sampler=synthetic(cfg.train.seed + 1))
    clock = [0.0]

    class Clocked:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __call__(self, batch):
            clock[0] += 1.0
            return self.inner(batch)

        def evaluate(self, batch):
            clock[0] += 100.0
            return self.inner.evaluate(batch)

    c = dataclasses.replace(c, step=Clocked(c.step))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    recorder = Recorder()
    loop.train_loop(
        c,
        start_step=0,
        total_steps=4,
        grad_clip=1.0,
        log_interval=1,
        checkpoint_interval=0,
        callbacks=[recorder],
        eval_interval=2,
        eval_steps=1,
    )
    records = recorder.records
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert [r["step_time_s"] for r in records[1:]] == [1.0, 1.0, 1.0]  # the first window began on the real clock
