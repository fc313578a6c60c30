"""What `llmforge plan` and `estimate --search` say: the newer keys are shown, a key that
would do nothing is refused, and an elastic plan's search ranks layouts whose pasted
overrides are accepted."""

from __future__ import annotations

from typer.testing import CliRunner

from llmforge.cli import app

runner = CliRunner()
ELASTIC = ["parallel.dp=auto", "cluster.nodes=2", "cluster.min_nodes=1", "cluster.devices_per_node=2", "cluster.max_restarts=3"]


def output(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


def test_plan_shows_masks_windows_offload_fp8_anomaly_and_the_elastic_range():
    text = output(
        "plan",
        "model.sliding_window=64",
        "model.sliding_window_every=2",
        "model.attention_mask=document",
        "model.position_reset=true",
        "parallel.offload=states",
        "parallel.zero=3",
        "parallel.offload_activations=true",
        "train.anomaly=rollback",
        *ELASTIC,
    )
    for words in (
        "document mask",
        "sliding window 64 on layers 0, 2",
        "positions restart at each document",
        "states (master weights",
        "saved activations in host memory",
        "rollback:",
        "at most 3 rollback(s)",
        "elastic: 1-2 nodes",
    ):
        assert words in text, (words, text)
    assert "FP8 tensorwise (emulated)" in output("plan", "precision.fp8=true", "precision.fp8_emulate=true", "precision.fp8_linears=all")
    plain = output("plan")
    assert "causal mask" in plain and "offload none" in plain and "skip: a non-finite step is skipped" in plain


def test_window_layers_without_a_window_are_refused_naming_the_fix():
    for key in ("model.sliding_window_layers=[1]", "model.sliding_window_every=2"):
        result = runner.invoke(app, ["plan", key])
        assert result.exit_code == 2 and "Traceback" not in result.output
        name = key.split("=")[0]
        assert name in result.output and "model.sliding_window is 0" in result.output
    output("plan", "model.sliding_window=64", "model.sliding_window_layers=[1]")  # the suggested fix is accepted


def test_an_elastic_search_ranks_layouts_that_the_plan_accepts():
    text = output("estimate", "--search", *ELASTIC)
    assert "Nothing fits" not in text and "None of the" not in text and "#1: parallel.dp=auto" in text
    first = text.split("#1: ")[1].split(" #2")[0].split()
    output("plan", *ELASTIC, *first)
