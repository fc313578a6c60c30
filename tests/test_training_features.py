"""Validation loss on the held-out split, the warmup-stable-decay schedule, the profiler
trace and TensorBoard, through one real run and a resume (one process; the layouts are
covered in test_parallel.py and test_restart.py)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from llmforge.checkpoint.resume import plan_for_resume
from llmforge.config.compose import compose
from llmforge.config.schema import OptimConfig
from llmforge.errors import UserError
from llmforge.observe.metrics import read_metrics
from llmforge.plan import RunPlan
from llmforge.train.components import RankInfo
from llmforge.train.optim import lr_factor
from llmforge.train.run import run

TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.steps=8",
    "train.log_interval=1",
    "train.lr=1e-3",
    "checkpoint.interval=2",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=2",
    "data.val_fraction=0.05",
    "train.eval_interval=3",
    "train.eval_steps=2",
    "optim.schedule=wsd",
    "optim.decay_fraction=0.5",
    "optim.decay_shape=sqrt",
    "optim.min_lr_ratio=0.1",
    "train.profile=2-3",
    "logging.tensorboard=true",
]


def test_wsd_warms_up_holds_then_decays_in_each_shape():
    for shape, mid in (("linear", 0.55), ("cosine", 0.55), ("sqrt", 1 - 0.9 * math.sqrt(0.5))):
        optim = OptimConfig(warmup_steps=2, schedule="wsd", decay_fraction=0.4, decay_shape=shape, min_lr_ratio=0.1)
        factors = [lr_factor(s, optim=optim, total_steps=10) for s in range(12)]
        assert factors[:2] == [0.5, 1.0] and factors[2:6] == [1.0] * 4  # warm-up, then stable until 10 - 4
        assert factors[8] == pytest.approx(mid)  # halfway through the decay
        assert factors[10:] == [pytest.approx(0.1)] * 2  # the floor after the last step
        assert all(a >= b for a, b in zip(factors[1:], factors[2:], strict=False))


def test_schedule_keys_are_checked():
    with pytest.raises(UserError) as err:
        RunPlan.build(
            compose(
                ["optim.schedule=wsd", "optim.decay_fraction=0", "optim.decay_shape=square", "train.eval_interval=5", "data.val_fraction=0"]
            )
        )
    text = err.value.message()
    assert "optim.decay_fraction = 0" in text and "optim.decay_shape = 'square'" in text
    assert "train.eval_interval = 5" in text and "data.val_fraction" in text


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data):
    run_dir = tmp_path_factory.mktemp("val-reference")
    plan = RunPlan.build(compose([*TINY, *small_data, f"run.dir={run_dir}"]))
    summary = run(plan, rank=RankInfo())
    return run_dir, plan, summary, {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def test_val_loss_is_logged_every_interval_and_at_the_end(reference):
    _, plan, summary, records = reference
    validated = [s for s, r in records.items() if "val_loss" in r]
    assert validated == [3, 6, 8]
    for s in validated:
        assert records[s]["val_perplexity"] == pytest.approx(math.exp(records[s]["val_loss"]))
        assert math.isfinite(records[s]["val_loss"])
    assert summary.val_loss == records[8]["val_loss"]
    assert [records[s]["lr"] for s in range(1, 9)] == [
        pytest.approx(1e-3 * lr_factor(s, optim=plan.config.optim, total_steps=8)) for s in range(8)
    ]


def test_resume_continues_the_schedule_and_both_streams_exactly(reference, tmp_path):
    run_dir, *_, expected = reference
    plan, path = plan_for_resume([f"ckpt={run_dir}/checkpoints/step_4", f"run.dir={tmp_path}"])
    run(plan, rank=RankInfo(), resume_from=path)
    got = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert sorted(got) == [5, 6, 7, 8]
    for s, record in got.items():  # bit-identical: lr, loss and the validation batches continue
        assert {k: record.get(k) for k in ("lr", "loss", "val_loss")} == {k: expected[s].get(k) for k in ("lr", "loss", "val_loss")}


def test_profile_writes_a_chrome_trace_of_the_step_range(reference):
    run_dir, *_ = reference
    traces = sorted((run_dir / "profile").glob("*.pt.trace.json"))
    assert [p.name for p in traces] == ["rank0.steps2-3.pt.trace.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2  # the two profiled steps, after one warm-up step
    assert any(e.get("name") == "aten::mm" or e.get("name") == "aten::addmm" for e in events)


def test_tensorboard_gets_every_logged_metric(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, *_, records = reference
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {"loss", "lr", "grad_norm", "val_loss", "val_perplexity"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("val_loss")] == [3, 6, 8]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([records[s]["loss"] for s in range(1, 9)])


def test_missing_tensorboard_is_refused_with_the_fix(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from llmforge.cli import app

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without the package imports
    result = CliRunner().invoke(app, ["pretrain", "logging.tensorboard=true", f"run.dir={tmp_path}/run"])
    assert result.exit_code == 2, result.output
    text = result.output.replace("\n", " ")
    assert "logging.tensorboard" in text and "pip install 'llmforge[tensorboard]'" in text and "Traceback" not in text
    assert not (tmp_path / "run").exists()


def test_out_of_memory_names_the_snapshot_and_the_estimate(tmp_path):
    from llmforge.observe.profile import out_of_memory_error

    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB\nmore")
    err = out_of_memory_error(exc, rank=3, step=7, snapshot=tmp_path / "oom_step7_rank3.pickle", plan_path=tmp_path / "plan.json")
    text = err.message()
    assert err.exit_code == 2
    assert "rank 3 ran out of GPU memory in step 7: CUDA out of memory. Tried to allocate 2.00 GiB" in text
    assert f"{tmp_path}/oom_step7_rank3.pickle" in text and f"llmforge estimate --plan {tmp_path}/plan.json" in text
