"""Quantization-aware training (torchao QAT): what is fake-quantized, the start step,
exact resume, the quantized export and its reload, and the refusals."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from gloo_runs import run_harness
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.observe.metrics import read_metrics
from llmforge.testing.harness import tiny_plan, train_layout
from llmforge.train.build import build_model

pytest.importorskip("torchao")

runner = CliRunner()
QAT = ["precision.qat=int8-int4", "precision.qat_group_size=16"]
RUN = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "model.vocab_size=512",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_interval=1",
    "checkpoint.interval=2",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=2",
    "train.eval_steps=1",
]


def _kinds(model: torch.nn.Module) -> dict:
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_only_the_blocks_linears_are_fake_quantized_and_the_output_changes():
    from llmforge.parallel.qat import apply_qat, set_fake_quant

    plan = tiny_plan(["model.tie_embeddings=false", "model.moe.num_experts=4", "model.moe.num_shared_experts=1", "model.moe.every=2"])
    model = build_model(plan, device=torch.device("cpu"))
    plain = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    assert apply_qat(model, scheme="int8-int4", group_size=16) > 0
    kinds = _kinds(model)
    assert kinds["head"] == "Linear" and kinds["layers.1.mlp.router"] == "Linear"
    assert kinds["layers.1.mlp.shared.up_proj"] == "FakeQuantizedLinear"
    for name in ("attn.qkv_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
        assert kinds[f"layers.0.{name}"] == "FakeQuantizedLinear"
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys
    tokens = torch.randint(0, plan.config.model.vocab_size, (2, 16))
    assert not torch.allclose(model(tokens), plain(tokens), atol=1e-3)  # it really rounds
    set_fake_quant([model], enabled=False)
    assert torch.equal(model(tokens), plain(tokens))


@pytest.mark.parametrize("start", [0, 1, 2, 3])
def test_fake_quantization_is_on_exactly_from_the_start_step(start):
    from llmforge.parallel.qat import apply_qat
    from llmforge.train.build import _qat_switch

    plan = tiny_plan([*QAT, f"precision.qat_start_step={start}", "model.num_layers=1"])
    model = build_model(plan, device=torch.device("cpu"))
    apply_qat(model, scheme="int8-int4", group_size=16)
    quantizers = [m for n, m in model.named_modules() if n.endswith("weight_fake_quantizer")]
    assert quantizers
    before_step = _qat_switch(plan, parts=[model])
    on = []
    for step in range(1, 5):  # 1-based, as the loop numbers its steps
        before_step(step)
        on.append(all(q.enabled for q in quantizers))
    assert on == [step >= start for step in range(1, 5)], on


def test_qat_trains_and_switches_on_at_its_start_step():
    plain = train_layout(tiny_plan([]))
    late = train_layout(tiny_plan(QAT + ["precision.qat_start_step=3"]))
    assert all(torch.isfinite(torch.tensor(late.losses)))
    assert late.losses[:2] == plain.losses[:2]  # steps 1-2 train in full precision
    assert all(a != b for a, b in zip(late.losses[2:], plain.losses[2:], strict=False))  # fake-quantized from step 3
    assert late.losses[-1] < late.losses[0]


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory, small_data) -> Path:
    """6 steps, QAT from step 4, a checkpoint every 2 steps."""
    run_dir = tmp_path_factory.mktemp("qat") / "run"
    result = runner.invoke(app, ["pretrain", *RUN, *small_data, *QAT, "precision.qat_start_step=4", f"run.dir={run_dir}"])
    assert result.exit_code == 0, result.output
    return run_dir


def _losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def test_a_resumed_qat_run_continues_identically(qat_run, tmp_path):
    """Resumed at step 2 (before QAT starts) and at step 4 (after), the later steps repeat the
    uninterrupted run's losses bit for bit."""
    expected = _losses(qat_run)
    for step in (2, 4):
        result = runner.invoke(app, ["resume", f"ckpt={qat_run}/checkpoints/step_{step}", f"run.dir={tmp_path / str(step)}"])
        assert result.exit_code == 0, result.output
        got = _losses(tmp_path / str(step))
        assert sorted(got) == list(range(step + 1, 7)) and all(got[s] == expected[s] for s in got), (step, got, expected)


def test_export_writes_a_quantized_model_whose_logits_match_the_fake_quantized_one(qat_run, tmp_path):
    from llmforge.checkpoint.quantized import QUANTIZATION_FILE, load_quantized
    from llmforge.checkpoint.resume import checkpoint_plan
    from llmforge.generate import load_model
    from llmforge.parallel.qat import apply_qat

    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", f"ckpt={qat_run}", "--out", str(out)])  # auto: the run's scheme
    assert result.exit_code == 0, result.output
    assert {"model.safetensors", "config.json", "quantized.safetensors", QUANTIZATION_FILE} <= {p.name for p in out.iterdir()}
    quantized = load_quantized(out)
    weight = quantized.layers["0"].mlp.up_proj.weight
    assert type(weight).__module__.startswith("torchao") and weight.qdata.dtype == torch.int8
    assert int(weight.qdata.min()) >= -8 and int(weight.qdata.max()) <= 7  # int4 levels
    step = qat_run / "checkpoints" / "step_6"
    config = checkpoint_plan(step).config
    fake = load_model(step, config=config, device=torch.device("cpu")).eval()
    apply_qat(fake, scheme="int8-int4", group_size=16)
    tokens = torch.randint(0, config.model.vocab_size, (2, 32))
    with torch.no_grad():
        want, got = fake(tokens), quantized(tokens)
        plain = load_model(step, config=config, device=torch.device("cpu")).eval()(tokens)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert (got - plain).abs().max() > 1e-3  # the reload is quantized, not the full-precision model


@pytest.mark.slow
def test_zero3_and_pipeline_qat_follow_one_process(tmp_path):
    """dp2 ZeRO-3 (FSDP2 gathers the weights, the fake quantizers round the whole tensor) and pp2
    fake-quantize as one process does: step 1 to fp32 tolerance; later steps within 2e-3, since a
    last-bit difference of the reduced gradients can move a weight to the neighbouring int4 level
    (measured: 2e-4 on the losses, 3e-3 on the weights after 5 steps)."""
    layouts = {"zero3": ["parallel.dp=2", "parallel.zero=3"], "pp2": ["parallel.pp=2"]}
    got = run_harness(tmp_path, {"base": QAT, "layouts": layouts}, nproc=2)
    ref, plain = train_layout(tiny_plan(QAT)), train_layout(tiny_plan([]))
    assert abs(ref.losses[0] - plain.losses[0]) > 1e-4  # the reference fake-quantizes
    for name in layouts:
        losses = got[name]["losses"]
        assert abs(losses[0] - ref.losses[0]) / ref.losses[0] < 1e-6, name
        assert max(abs(a - b) / b for a, b in zip(losses, ref.losses, strict=False)) < 2e-3, name
        for param, value in ref.params.items():
            assert float((got[name]["params"][param] - value).norm() / value.norm()) < 2e-2, (name, param)


def _refused(args: list, *needles: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "Traceback" not in text
    for needle in needles:
        assert needle in text, (needle, text)


def _problems(*overrides: str) -> str:
    from llmforge.config.compose import compose
    from llmforge.errors import UserError
    from llmforge.plan import RunPlan

    with pytest.raises(UserError) as info:
        RunPlan.build(compose(list(overrides)))
    return " ".join(info.value.message().split())


def test_layouts_torchao_has_no_qat_config_for_are_refused():
    _refused(["plan", *QAT, "precision=fp8", "precision.fp8_emulate=true"], "precision.qat = 'int8-int4'", "precision.fp8=false")
    _refused(["plan", *QAT, "parallel=tp2"], "tensor-parallel (DTensor) weights", "parallel.tp=1")
    checks = {
        ("precision.qat_start_step=400",): ("precision.qat_start_step = 400", "never fake-quantize"),
        ("precision.qat=int2",): ("precision.qat = 'int2'", "int8-int4"),
        ("precision.qat=none", "precision.qat_start_step=5"): ("precision.qat is none",),
        ("precision.qat=int4", "precision.qat_group_size=48"): ("precision.qat_group_size = 48", "divides no linear layer"),
    }
    for overrides, needles in checks.items():
        text = _problems(*QAT, *overrides)
        assert all(n in text for n in needles), (overrides, text)
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    assert RunPlan.build(compose([*QAT, "parallel=fsdp", "parallel.dp=2"])).config.parallel.zero == 3  # ZeRO-3 takes QAT


def test_export_refuses_a_bad_quantize_option(qat_run, tmp_path):
    _refused(["export", f"ckpt={qat_run}", "--out", str(tmp_path / "a"), "--quantize", "int3"], "--quantize = 'int3'", "int8-int4")
    _refused(
        ["export", f"ckpt={qat_run}", "--out", str(tmp_path / "b"), "--quantize", "int4"], "precision.qat=int8-int4", "--quantize int8-int4"
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
