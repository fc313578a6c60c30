"""FP8 that pays or is refused: plan and estimate list the float8 linears and their estimated gains,
and an FP8 plan the estimate says does not pay ends in exit 2 naming the linears and the fix."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.compose import compose
from llmforge.estimate.core import estimate_plan
from llmforge.estimate.fp8_report import MIN_STEP_GAIN, fp8_verdict
from llmforge.plan import RunPlan

runner = CliRunner()
COMPILED_FP8 = ["precision=fp8", "train.compile=true"]


def verdict_of(*overrides: str):
    verdict = fp8_verdict(estimate_plan(RunPlan.build(compose(list(overrides)))))
    assert verdict is not None
    return verdict


@pytest.mark.parametrize("accelerator", ["h100-80gb", "h200-141gb"])
def test_width_768_is_refused_and_2048_and_4096_pay(accelerator):
    on = f"cluster.accelerator={accelerator}"
    small = verdict_of("recipe=gpt-125m", *COMPILED_FP8, on)
    assert [g.linear.name for g in small.float8] == ["attn.qkv_proj", "mlp.up_proj"]
    assert small.speedup < MIN_STEP_GAIN and small.problems()
    assert all(g.speedup < 1.05 for g in small.float8)  # H100: each slower than bf16; H200's bandwidth: about even
    for recipe in ("gpt-1b", "llama-8b"):
        wide = verdict_of(f"recipe={recipe}", *COMPILED_FP8, on)
        assert len(wide.float8) == 4 and all(g.speedup > 1 for g in wide.float8), recipe
        assert wide.speedup >= MIN_STEP_GAIN and not wide.problems()


def test_plan_refuses_fp8_that_does_not_pay_and_force_shows_it():
    result = runner.invoke(app, ["plan", "recipe=gpt-125m", *COMPILED_FP8])
    assert result.exit_code == 2 and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "precision.fp8 = True" in text and "attn.qkv_proj 768 -> 2304" in text and "pass --force" in text
    assert "precision=bf16" in text
    forced = runner.invoke(app, ["plan", "recipe=gpt-125m", *COMPILED_FP8, "--force"])
    assert forced.exit_code == 0, forced.output
    assert "attn.o_proj" in forced.output and "too small for tensorwise float8 to pay" in forced.output


def test_plan_and_estimate_list_the_float8_linears_with_their_gain():
    result = runner.invoke(app, ["plan", "recipe=gpt-1b", *COMPILED_FP8])
    assert result.exit_code == 0, result.output
    assert "estimated step" in result.output and result.output.count("float8 1.") == 4
    estimate = runner.invoke(app, ["estimate", "recipe=gpt-1b", *COMPILED_FP8, "--json"])
    assert estimate.exit_code == 0, estimate.output
    fp8 = json.loads(estimate.stdout)["fp8"]
    assert fp8["step_speedup"] > 1 and [x["float8"] for x in fp8["dense"]] == [True] * 4 and not fp8["problems"]


def test_estimate_and_pretrain_refuse_it_too_and_emulation_never():
    for command in (["estimate"], ["pretrain", "--dry-run"]):
        result = runner.invoke(app, [*command, "recipe=gpt-125m", *COMPILED_FP8])
        assert result.exit_code == 2 and "FP8 does not pay" in result.output, command
    emulated = runner.invoke(app, ["plan", "precision=fp8", "precision.fp8_emulate=true", "precision.fp8_linears=all"])
    assert emulated.exit_code == 0, emulated.output


def test_emulated_fp8_that_would_convert_nothing_is_refused():
    result = runner.invoke(app, ["plan", "precision=fp8", "precision.fp8_emulate=true"])  # the tiny recipe: 128 wide
    assert result.exit_code == 2 and "precision.fp8_linears = 'auto'" in result.output
    assert "precision.fp8_linears=all" in " ".join(result.output.split())
