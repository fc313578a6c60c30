"""``llmforge estimate --search``: valid, fitting, sensible winners; honest failures."""

from __future__ import annotations

import json

import pytest

from llmforge.estimate.core import estimate
from llmforge.estimate.search import search, search_plan, structures, why
from llmforge.estimate.shape import Job, Shape
from llmforge.hardware import get_profile
from llmforge.layout import Layout

# Narayanan et al. 2021, Table 1 (A100 80GB, s=2048, V=51200): heads, hidden, layers, t, p, GPUs, batch
NARAYANAN = [
    (24, 2304, 24, 1, 1, 32, 512),
    (32, 3072, 30, 2, 1, 64, 512),
    (32, 4096, 36, 4, 1, 128, 512),
    (48, 6144, 40, 8, 1, 256, 1024),
    (64, 8192, 48, 8, 2, 512, 1536),
    (80, 10240, 60, 8, 4, 1024, 1792),
]


def gpt(*, heads, hidden, layers, vocab=51200, seq=2048) -> Shape:
    return Shape(num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab, seq=seq)


def job(accel: str, *, batch: int, world: int, devices: int = 8) -> Job:
    return Job(
        global_batch=batch,
        param_dtype="bf16",
        reduce_dtype="fp32",
        profile=get_profile(accel),
        nodes=max(1, world // devices),
        devices_per_node=min(world, devices),
    )


def _published_estimate(shape: Shape, jb: Job, *, t: int, p: int, world: int):
    """The best our estimator makes of the published (t, p): Megatron's distributed optimizer
    (ZeRO-1), sequence parallel, micro batch 1, the least recompute that fits."""
    dp = world // (t * p)
    for recompute in ("none", "selective", "full"):
        layout = Layout(dp=dp, tp=t, pp=p, zero=1, sequence_parallel=t > 1, micro_batch_size=1, recompute=recompute)
        est = estimate(shape, layout, jb)
        if est.fits:
            return est
    return est


def _check_ranked(result) -> None:
    assert result.ranked, "nothing fits"
    for est in result.ranked:
        full = estimate(est.shape, est.layout, est.job)  # every pipeline stage, not only representatives
        assert full.fits and full.worst.total <= est.job.profile.memory_bytes
        assert full.worst.total == pytest.approx(est.worst.total)
    speeds = [e.tokens_per_s for e in result.ranked]
    assert speeds == sorted(speeds, reverse=True)


@pytest.mark.parametrize("heads,hidden,layers,t,p,world,batch", NARAYANAN)
def test_search_beats_or_matches_narayanan_table1(heads, hidden, layers, t, p, world, batch):
    shape = gpt(heads=heads, hidden=hidden, layers=layers)
    jb = job("a100-80gb", batch=batch, world=world)
    result = search(shape, jb, world=world, top=3)
    _check_ranked(result)
    published = _published_estimate(shape, jb, t=t, p=p, world=world)
    assert published.layout.dp * t * p == world
    if published.fits:
        assert result.ranked[0].tokens_per_s >= published.tokens_per_s * (1 - 1e-9)


def test_search_beats_or_matches_megatron_h100_gpt3():
    """Megatron-LM README: GPT-3 175B (vocab 131072) on H100 with TP=4, PP=8; batch 1152 on 384 GPUs."""
    shape = gpt(heads=96, hidden=12288, layers=96, vocab=131072)
    jb = job("h100-80gb", batch=1152, world=384)
    result = search(shape, jb, world=384, top=3)
    _check_ranked(result)
    published = _published_estimate(shape, jb, t=4, p=8, world=384)
    assert published.fits
    assert result.ranked[0].tokens_per_s >= published.tokens_per_s


def test_seven_billion_on_one_node_prefers_no_pipeline():
    shape = gpt(heads=32, hidden=4096, layers=32, vocab=50304)
    result = search(shape, job("h100-80gb", batch=512, world=8), world=8, top=3)
    _check_ranked(result)
    assert result.ranked[0].layout.pp == 1


def test_seventy_billion_on_one_small_gpu_says_what_would_fit():
    shape = Shape(
        num_layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        ffn=28672,
        vocab=128256,
        seq=8192,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        tie_embeddings=False,
        bias=False,
    )
    jb = Job(global_batch=8, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("l4-24gb"), nodes=1, devices_per_node=1)
    result = search(shape, jb, world=1, top=3)
    assert not result.ranked and result.fitting == 0
    text = "\n".join(result.suggestions)
    assert "needs" in text and "more than it has" in text
    assert "More devices" in text and "ZeRO-3" in text and "full recompute" in text and "parallel.zero=3" in text
    n = int(text.split("More devices: ")[1].split(" x ")[0])
    assert n > 1 and n & (n - 1) == 0


def test_every_structure_passes_plan_validation():
    from llmforge.config.compose import compose
    from llmforge.estimate.search import _micro_batches, plan_config
    from llmforge.estimate.shape import from_plan
    from llmforge.plan import RunPlan

    plan = RunPlan.build(
        compose(
            ["recipe=moe-tiny", "cluster.devices_per_node=8", "parallel.dp=auto", "train.micro_batch_size=1", "train.global_batch_size=64"]
        )
    )
    shape, _, jb = from_plan(plan)
    seen = 0
    for structure in structures(shape, jb, 8):
        for mb in _micro_batches(jb, structure.dp, structure.pp, structure.pp_schedule):
            layout = Layout(**{**{f: getattr(structure, f) for f in Layout.__dataclass_fields__}, "micro_batch_size": mb})
            RunPlan.build(plan_config(plan, layout))
            seen += 1
    assert seen > 50


def test_why_names_the_term_that_differs():
    shape = gpt(heads=32, hidden=4096, layers=32, vocab=50304)
    jb = job("h100-80gb", batch=512, world=16, devices=8)
    flat = estimate(shape, Layout(dp=8, tp=2, sequence_parallel=True, zero=1, micro_batch_size=1), jb)
    piped = estimate(shape, Layout(dp=2, tp=2, pp=4, sequence_parallel=True, zero=1, micro_batch_size=1), jb)
    best, runner = sorted([flat, piped], key=lambda e: e.step_s)
    text = why(best, runner)
    assert text.startswith("#1 is") and ("bubble" in text or "communication" in text or "compute" in text)


def test_cli_search_json(capsys):
    from rich.console import Console

    from llmforge.commands.estimate import run_estimate
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    plan = RunPlan.build(compose(["recipe=gpt-7b", "cluster.nodes=1"]))
    run_estimate(plan, as_json=True, timeline=False, measure=False, search=True, top=3, console=Console())
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 8 and len(data["top"]) == 3 and not data["nothing_fits"]
    assert data["top"][0]["fits"] and data["top"][0]["overrides"].startswith("parallel.dp=")
    assert data["evaluated"] >= data["fitting"] > 0 and data["why"]
    assert search_plan(plan, top=3).ranked[0].layout.overrides() == data["top"][0]["overrides"]


def test_cli_search_table_and_nothing_fits():
    from rich.console import Console

    from llmforge.commands.estimate import run_estimate
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    console = Console(record=True, width=200)
    plan = RunPlan.build(compose(["recipe=gpt-1b"]))
    run_estimate(plan, as_json=False, timeline=False, measure=False, search=True, top=2, console=console)
    text = console.export_text()
    assert "Fastest layouts that fit" in text and "#1: parallel.dp=" in text and "#2:" in text
    big = RunPlan.build(
        compose(
            [
                "recipe=llama-8b",
                "model=llama-70b",
                "parallel=single",
                "cluster.nodes=1",
                "cluster.devices_per_node=1",
                "cluster.accelerator=l4-24gb",
                "train.global_batch_size=8",
            ]
        )
    )
    console = Console(record=True, width=200)
    run_estimate(big, as_json=False, timeline=False, measure=False, search=True, top=2, console=console)
    assert "Nothing fits." in console.export_text()
