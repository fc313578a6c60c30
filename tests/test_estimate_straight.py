"""The estimator reads no files (document lengths come in with the plan), and one
``pretrain`` computes one estimate, which its checks, meter and closing line share."""

from __future__ import annotations

import builtins
import io
import os
import pathlib

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.estimate import core, shape
from llmforge.estimate.core import estimate
from llmforge.estimate.search import search
from llmforge.layout import Layout
from llmforge.testing.harness import TINY, tiny_plan


def _refuse(*args, **kwargs):
    raise AssertionError(f"the estimator read a file: {args[:1]}")


def _without_file_io(patch: pytest.MonkeyPatch) -> None:
    """Every way the estimator could read a file raises (until the context ends)."""
    for target, name in (
        (builtins, "open"),
        (io, "open"),
        (os, "open"),
        (os, "scandir"),
        (os, "listdir"),
        (pathlib.Path, "open"),
        (pathlib.Path, "read_text"),
        (pathlib.Path, "read_bytes"),
        (pathlib.Path, "exists"),
        (pathlib.Path, "is_file"),
    ):
        patch.setattr(target, name, _refuse)


def test_the_estimate_of_a_document_masked_plan_reads_no_files(monkeypatch, small_data):
    plan = tiny_plan(["model.attention_mask=document", *small_data])
    profile = shape.job_from_plan(plan).profile  # the hardware profile is resolved before (llmforge.hardware reads it)
    monkeypatch.setattr(shape, "get_profile", lambda *a, **k: profile)
    monkeypatch.setattr(shape, "machine_memory", lambda: 16 * 2**30)
    with monkeypatch.context() as patch:
        _without_file_io(patch)
        s, _, job = shape.from_plan(plan)
        one = estimate(s, Layout(dp=2, tp=2, micro_batch_size=2), job)
        ranked = search(s, job, world=4, top=2).ranked
    assert s.attention_fraction == 1.0  # no document lengths passed: one document per window
    assert one.step_s > 0 and ranked


def test_one_pretrain_computes_one_estimate(monkeypatch, tmp_path, small_data):
    calls = []
    original = core.estimate

    def counted(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(core, "estimate", counted)
    args = [
        "pretrain",
        *TINY,
        "model.vocab_size=4096",
        *small_data,
        "train.steps=2",
        "train.log_interval=1",
        f"run.dir={tmp_path / 'run'}",
        "logging.console=false",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "measured/estimate" in result.output  # the closing line compared the run with the estimate
    assert len(calls) == 1


@pytest.mark.parametrize("kind", ["moe", "fp8_muon"])
def test_the_search_memo_gives_what_a_fresh_estimate_gives(kind):
    """The search's one memo (inventories and what they derived for its job) changes no figure:
    each ranked layout's estimate equals the estimate of that layout alone."""
    from dataclasses import replace

    from llmforge.estimate.shape import Job, Shape
    from llmforge.hardware import get_profile

    shape = Shape(num_layers=8, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000, seq=2048, norm="rmsnorm", activation="swiglu")
    job = Job(global_batch=64, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"), nodes=2, devices_per_node=8)
    if kind == "moe":
        shape = replace(shape, num_experts=8, top_k=2, moe_ffn=2048, moe_every=2)
    else:
        job = replace(job, fp8=True, fp8_all_gather=True, optimizer="muon")
    result = search(shape, job, world=16, top=6)
    assert len(result.ranked) == 6
    for found in result.ranked:
        alone = estimate(shape, found.layout, job, every_stage=False)
        assert (found.step_s, found.worst, found.parts, found.node) == (alone.step_s, alone.worst, alone.parts, alone.node)
