"""The estimate under precision.fp8 and HSDP: what runs at the FP8 peak, what the
casts and float8 gathers cost, what memory changes, and what --search proposes."""

from __future__ import annotations

import dataclasses

import pytest

from llmforge.estimate import fp8
from llmforge.estimate.core import estimate
from llmforge.estimate.flops import block_flops
from llmforge.estimate.inventory import inventory
from llmforge.estimate.pipeline import inflight_microbatches
from llmforge.estimate.search import replicate_options, search
from llmforge.estimate.shape import Job, Shape
from llmforge.hardware import get_profile
from llmforge.layout import Layout


def gpt(*, layers: int, hidden: int, heads: int, vocab: int = 50304, seq: int = 2048) -> Shape:
    return Shape(num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab, seq=seq)


LLAMA_8B = Shape(
    num_layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    ffn=14336,
    vocab=128256,
    seq=8192,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    tie_embeddings=False,
    bias=False,
)


def job(*, fp8_on: bool, batch: int = 8, nodes: int = 1, devices: int = 8, all_gather: bool = True, accel: str = "h100-80gb") -> Job:
    return Job(
        global_batch=batch,
        param_dtype="bf16",
        reduce_dtype="fp32",
        profile=get_profile(accel),
        nodes=nodes,
        devices_per_node=devices,
        fp8=fp8_on,
        fp8_all_gather=fp8_on and all_gather,
    )


@pytest.mark.parametrize(
    "name,has", [("h100-80gb", True), ("h200-141gb", True), ("b200", True), ("l4-24gb", True), ("a100-80gb", False), ("cpu", False)]
)
def test_profiles_say_which_accelerators_have_fp8(name, has):
    profile = get_profile(name)
    assert profile.has_fp8 is has
    if has:
        assert profile.peak("fp8") == pytest.approx(2 * profile.peak("bf16"), rel=0.01)


def test_with_all_linears_every_block_matmul_of_a_dense_model_runs_in_fp8():
    shape = dataclasses.replace(gpt(layers=4, hidden=1024, heads=16), fp8_linears="all")
    inv = inventory(shape, Layout())
    assert fp8.stage_flops_per_token(inv, inv.counts(0)) == pytest.approx(4 * 3 * block_flops(shape, moe=False).weights)


def test_router_and_routed_experts_stay_in_bf16():
    dense = gpt(layers=2, hidden=1024, heads=16)
    moe = dataclasses.replace(dense, num_experts=8, top_k=2, moe_ffn=2048, shared_experts=1, fp8_linears="all")
    forward = fp8.block_flops(moe, moe=True, mode="none") / 3
    attention_projections = 2 * 4 * 1024 * 1024
    shared_mlp = 2 * 2 * 1024 * 2048
    assert forward == attention_projections + shared_mlp
    assert forward < block_flops(moe, moe=True).weights


def test_fp8_pays_off_with_width_and_only_compiled():
    """As measured on an H100 (docs/fp8.md): compiled, no gain at width 768 (its two float8
    linears lose to their casts), a few percent at 2048, more at 4096; eager, less at every width."""
    gains: dict[bool, list[float]] = {True: [], False: []}
    for hidden, heads, mb in ((768, 12, 8), (2048, 16, 4), (4096, 32, 2)):
        shape, layout = gpt(layers=8, hidden=hidden, heads=heads), Layout(micro_batch_size=mb)
        for compiled in (True, False):
            bf16 = estimate(shape, layout, dataclasses.replace(job(fp8_on=False, batch=mb, devices=1), compile=compiled))
            ours = estimate(shape, layout, dataclasses.replace(job(fp8_on=True, batch=mb, devices=1), compile=compiled))
            gains[compiled].append(ours.tokens_per_s / bf16.tokens_per_s)
    compiled, eager = gains[True], gains[False]
    assert compiled[0] < 1.0 < compiled[1] < compiled[2] < 1.5
    assert all(e < c for e, c in zip(eager, compiled, strict=True)) and eager[0] < 0.95


def test_without_fp8_tensor_cores_nothing_gets_faster():
    shape, layout = gpt(layers=4, hidden=2048, heads=16), Layout(micro_batch_size=2)
    bf16 = estimate(shape, layout, job(fp8_on=False, batch=2, devices=1, accel="a100-80gb"))
    ours = estimate(shape, layout, job(fp8_on=True, batch=2, devices=1, accel="a100-80gb"))
    assert ours.parts["compute"] == bf16.parts["compute"]


def test_fp8_keeps_no_16_bit_copies_of_the_converted_weights():
    shape, layout = gpt(layers=4, hidden=1024, heads=16), Layout(micro_batch_size=2)
    bf16 = estimate(shape, layout, job(fp8_on=False, batch=4, devices=1))
    ours = estimate(shape, layout, job(fp8_on=True, batch=4, devices=1))
    copies = 4 * fp8.converted_numel(shape, moe=False) * 2 * inflight_microbatches(layout, stage=0, microbatches=2)
    assert bf16.worst.activations - ours.worst.activations == pytest.approx(copies)
    assert ours.worst.transient > bf16.worst.transient  # one layer's float8 working set


def test_float8_all_gather_moves_fewer_bytes_under_zero3():
    shape, layout = gpt(layers=4, hidden=2048, heads=16), Layout(dp=8, zero=3, micro_batch_size=1)
    wide = estimate(shape, layout, job(fp8_on=True, all_gather=False))
    narrow = estimate(shape, layout, job(fp8_on=True))
    # one microbatch per rank: every block gathered for forward, all but the last (kept gathered) for backward
    gathers = 4 + 3
    # ZeRO-3 gathers the bf16 compute copy (2 bytes an element), float8 gathers 1 byte
    saved = gathers * fp8.converted_numel(shape, moe=False) * 7 / 8 * 1
    assert wide.comm.bytes_of("dp") - narrow.comm.bytes_of("dp") == pytest.approx(saved)


def test_hsdp_keeps_gathers_on_nvlink_and_pays_in_memory():
    """llama-8b on 8 nodes: sharding over one node keeps the gathers on NVLink, and the
    gradient shard's all-reduce over the 8 replicas goes over the network after the
    reduce-scatter. ZeRO-3 over all 64 ranks drives every NIC of a node at once (8 of a
    node's ranks are in the group), so HSDP buys no bandwidth here and pays in memory."""
    jb = job(fp8_on=False, batch=64, nodes=8)
    plain = estimate(LLAMA_8B, Layout(dp=64, zero=3, recompute="full", micro_batch_size=1), jb)
    hsdp = estimate(LLAMA_8B, Layout(dp=64, zero=3, recompute="full", micro_batch_size=1, dp_replicate=8), jb)
    gathers, reduces = (lambda e: e.comm.kinds["dp_all_gather"].seconds), (lambda e: e.comm.kinds["dp_reduce_scatter"].seconds)
    assert gathers(hsdp) < gathers(plain) and reduces(hsdp) > reduces(plain)
    assert hsdp.parts["dp_comm"] < 0.05 * hsdp.step_s and plain.parts["dp_comm"] < 0.05 * plain.step_s  # mostly hidden behind blocks
    assert hsdp.worst.optimizer == pytest.approx(8 * plain.worst.optimizer, rel=1e-3)  # sharded over 8 ranks, not 64


def test_search_proposes_hsdp_on_multi_node_clusters_only():
    assert replicate_options(dp=8, tp=1, cp=1, ep=1, zero=3, node_size=8) == [1]  # one node
    assert replicate_options(dp=64, tp=1, cp=1, ep=1, zero=3, node_size=8) == [1, 2, 4, 8]
    assert replicate_options(dp=32, tp=2, cp=1, ep=1, zero=3, node_size=8) == [1, 2, 4, 8]
    assert replicate_options(dp=64, tp=1, cp=1, ep=1, zero=0, node_size=8) == [1]
    result = search(LLAMA_8B, job(fp8_on=False, batch=64, nodes=8), world=64, top=40)  # dp_replicate=8 ranks 34th
    hsdp = [e.layout for e in result.ranked if e.layout.dp_replicate > 1]
    assert {lay.dp_replicate for lay in hsdp} == {2, 4, 8}
    assert "parallel.dp_replicate=8" in [lay for lay in hsdp if lay.dp_replicate == 8][0].overrides()
