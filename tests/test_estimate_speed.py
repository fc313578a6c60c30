"""The step-time model against measured runs (no torch)."""

from __future__ import annotations

import dataclasses

import pytest

from llmforge.estimate import kernels as kn
from llmforge.estimate.core import estimate
from llmforge.estimate.flops import hardware_flops
from llmforge.estimate.shape import Job, Shape
from llmforge.hardware import get_profile
from llmforge.layout import Layout

# One H100 80GB, torch 2.11, bf16 autocast, seq 2048, vocab 50304, one microbatch per step:
# a plain PyTorch loop (fp32 weights, SDPA, fused AdamW, clip_grad_norm_, cross-entropy on
# fp32 logits), median tokens/s over the later steps.
PLAIN_LOOP_H100 = {
    "gpt-125m mb8": (12, 768, 12, 8, 273_663),
    "gpt-350m mb8": (24, 1024, 16, 8, 126_064),
    "gpt-1b mb4": (24, 2048, 16, 4, 46_081),
}
# The same loop with every block compiled (``block.compile()``, the loss eager), same machine.
PLAIN_LOOP_H100_COMPILED = {
    "gpt-125m mb8": (12, 768, 12, 8, 302_610),
    "gpt-1b mb4": (24, 2048, 16, 4, 51_124),
}


def gpt(layers: int, hidden: int, heads: int) -> Shape:
    return Shape(num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=50304, seq=2048)


def plain_loop_tokens_per_s(shape: Shape, micro_batch: int, job: Job) -> float:
    """llmforge's estimate with its chunked loss swapped for the plain loop's cross-entropy on fp32 logits."""
    est = estimate(shape, Layout(micro_batch_size=micro_batch), job)
    sp, tokens = kn.speeds(job), micro_batch * shape.seq
    chunked = kn.loss_cost(sp, tokens=tokens, vocab=shape.vocab, c=2).seconds
    fp32 = kn.loss_cost(sp, tokens=tokens, vocab=shape.vocab, c=2, kind="fp32_logits").seconds
    return tokens / (est.step_s - chunked + fp32)


@pytest.mark.parametrize("name", list(PLAIN_LOOP_H100))
def test_h100_estimate_holds_to_the_measured_plain_loop(name):
    layers, hidden, heads, mb, measured = PLAIN_LOOP_H100[name]
    job = Job(global_batch=mb, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"))
    assert plain_loop_tokens_per_s(gpt(layers, hidden, heads), mb, job) == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("name", list(PLAIN_LOOP_H100_COMPILED))
def test_h100_compiled_estimate_holds_to_the_measured_compiled_loop(name):
    """train.compile fuses each block's memory-bound chains: faster than eager, as measured."""
    layers, hidden, heads, mb, measured = PLAIN_LOOP_H100_COMPILED[name]
    eager = Job(global_batch=mb, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"))
    compiled = dataclasses.replace(eager, compile=True)
    shape = gpt(layers, hidden, heads)
    assert plain_loop_tokens_per_s(shape, mb, compiled) == pytest.approx(measured, rel=0.15)
    assert plain_loop_tokens_per_s(shape, mb, compiled) > plain_loop_tokens_per_s(shape, mb, eager)


def test_wider_matmuls_run_closer_to_peak():
    sp = kn.speeds(Job(global_batch=1, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb")))
    rates = [2 * 16384 * d * d / sp.gemm(16384, d, d).seconds for d in (256, 768, 2048, 8192)]
    assert rates == sorted(rates) and rates[-1] < sp.peak * sp.matmul_efficiency
    assert rates[1] / rates[-1] < 0.9  # a 768-wide projection is well below what an 8192-wide one reaches


def test_selective_recompute_costs_only_elementwise_work():
    """Selective reruns the memory-bound forward (norms, casts, activations), no matmul
    and no attention: on gpt-1b that is about a tenth of a step, full recompute a third."""
    job = Job(global_batch=4, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"))
    shape = gpt(24, 2048, 16)
    none, selective, full = (estimate(shape, Layout(micro_batch_size=4, recompute=r), job) for r in ("none", "selective", "full"))
    assert selective.hardware_flops == none.hardware_flops < full.hardware_flops
    assert none.step_s < selective.step_s < 1.15 * none.step_s < full.step_s


def test_a_flat_efficiency_overrides_the_kernel_model():
    job = Job(global_batch=8, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"), efficiency=0.5)
    shape, layout = gpt(12, 768, 12), Layout(micro_batch_size=8)
    est = estimate(shape, layout, job)
    assert est.parts["compute"] == pytest.approx(hardware_flops(shape, layout, 8 * 2048) / (989.4e12 * 0.5))


def test_profile_rates_are_read_from_the_yaml(tmp_path):
    base = get_profile("h100-80gb")
    assert (base.matmul_efficiency, base.matmul_dim, base.kernel_floor_us) == (0.81, 48, 5)
    path = tmp_path / "slow.yaml"
    path.write_text(
        "name: slow\nmemory_gib: 80\npeak_tflops: {fp32: 67, bf16: 989.4, fp16: 989.4}\nmemory_bandwidth_gbs: 3350\n"
        "intra_node_gbs: 450\ninter_node_gbs: 50\ndevices_per_node: 8\nmatmul_efficiency: 0.405\n"
    )
    slow = get_profile(str(path))
    assert slow.matmul_efficiency == 0.405 and (slow.matmul_dim, slow.bandwidth_efficiency) == (base.matmul_dim, base.bandwidth_efficiency)
    job = Job(global_batch=8, param_dtype="bf16", reduce_dtype="fp32", profile=base)
    shape = gpt(12, 768, 12)
    assert (
        estimate(shape, Layout(micro_batch_size=8), dataclasses.replace(job, profile=slow)).step_s
        > estimate(shape, Layout(micro_batch_size=8), job).step_s
    )
