"""The estimate against the real model: parameters per rank, saved activations, FLOPs."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from tiny_models import GPT_TINY as GPT_TWO_BLOCKS  # noqa: E402
from tiny_models import LLAMA_TINY as LLAMA_TWO_BLOCKS  # noqa: E402

from llmforge.config.schema import MoEConfig  # noqa: E402
from llmforge.estimate.params import named_shapes  # noqa: E402
from llmforge.estimate.shape import Job, shape_from_config  # noqa: E402
from llmforge.hardware import get_profile  # noqa: E402
from llmforge.train import measure as ms  # noqa: E402

GPT_TINY = dataclasses.replace(GPT_TWO_BLOCKS, num_layers=3)
LLAMA_TINY = dataclasses.replace(LLAMA_TWO_BLOCKS, num_layers=3)
GELU_ROPE_NOBIAS = dataclasses.replace(GPT_TINY, position="rope", bias=False, num_kv_heads=2)
MOE_TINY = dataclasses.replace(
    LLAMA_TINY, num_layers=4, moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=48, num_shared_experts=1, every=2)
)
MOE_GELU = dataclasses.replace(GPT_TINY, moe=MoEConfig(num_experts=4, top_k=1, ffn_hidden_size=64, capacity_factor=2.0))
CONFIGS = {"gpt": GPT_TINY, "llama": LLAMA_TINY, "gelu-rope-gqa": GELU_ROPE_NOBIAS, "moe": MOE_TINY, "moe-gelu": MOE_GELU}


def _job(dtype: str) -> Job:
    """``measure`` runs autocast over fp32 weights with the residual stream in the compute dtype, as a run does."""
    return Job(global_batch=2, param_dtype=dtype, reduce_dtype="fp32", profile=get_profile("cpu"))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_names_and_shapes_equal_the_model(name):
    cfg = CONFIGS[name]
    assert named_shapes(shape_from_config(cfg)) == ms.count_parameters(cfg)


@pytest.fixture
def balanced_routing(monkeypatch):
    """Route token i to experts (i*k .. i*k+k-1) mod E: every expert gets the same load,
    the case the estimate describes (padded expert batches grow with imbalance)."""
    from llmforge.models import moe

    original = moe.route

    def route(logits, *, top_k, normalize, capacity, bias=None):
        r = original(logits, top_k=top_k, normalize=normalize, capacity=capacity, bias=bias)
        t, e = logits.shape
        experts = (torch.arange(t)[:, None] * top_k + torch.arange(top_k)[None, :]) % e
        keep = moe.capacity_keep(experts, num_experts=e, capacity=capacity)
        return moe.Routing(weights=r.weights, experts=experts, keep=keep, probs=r.probs, logits=r.logits)

    monkeypatch.setattr(moe, "route", route)


CASES = [(n, d, r) for n in sorted(CONFIGS) for d in ("fp32", "bf16") for r in ("none", "selective", "full")]


@pytest.mark.parametrize("name,dtype,recompute", CASES)
def test_activations_and_flops_match_measurement(name, dtype, recompute, balanced_routing):
    cfg = CONFIGS[name]
    got = ms.measure_config(cfg, micro_batch=2, param_dtype=dtype, recompute=recompute, fake=False)
    est = ms.single_process_estimate(shape_from_config(cfg), _job(dtype), micro_batch=2, recompute=recompute, every=1)
    assert est["saved_bytes"] == pytest.approx(got.saved_bytes, rel=0.10)
    assert est["forward_flops"] == pytest.approx(got.forward_flops, rel=0.02)
    assert est["backward_flops"] == pytest.approx(got.backward_flops, rel=0.02)


def test_recompute_every_second_block(balanced_routing):
    cfg = dataclasses.replace(LLAMA_TINY, num_layers=4)
    got = ms.measure_config(cfg, micro_batch=2, param_dtype="bf16", recompute="full", every=2, fake=False)
    est = ms.single_process_estimate(shape_from_config(cfg), _job("bf16"), micro_batch=2, recompute="full", every=2)
    none = ms.single_process_estimate(shape_from_config(cfg), _job("bf16"), micro_batch=2, recompute="none", every=1)
    assert est["saved_bytes"] == pytest.approx(got.saved_bytes, rel=0.10)
    assert est["backward_flops"] == pytest.approx(got.backward_flops, rel=0.02)
    assert est["saved_bytes"] < none["saved_bytes"]


def test_fake_tensors_and_layer_reduced_copies_measure_what_real_ones_do():
    cfg = dataclasses.replace(LLAMA_TINY, num_layers=6)
    real = ms.measure_config(cfg, micro_batch=2, param_dtype="bf16", fake=False)
    fake = ms.measure_config(cfg, micro_batch=2, param_dtype="bf16", fake=True)
    assert (fake.saved_bytes, fake.forward_flops, fake.backward_flops) == (real.saved_bytes, real.forward_flops, real.backward_flops)
    original = ms.REAL_LIMIT
    try:
        ms.REAL_LIMIT = 0  # force the fake, layer-reduced path
        scaled, how = ms._scaled(cfg, micro_batch=2, param_dtype="bf16", recompute="none", every=1)
    finally:
        ms.REAL_LIMIT = original
    assert "scaled to 6" in how
    assert (scaled.saved_bytes, scaled.forward_flops, scaled.backward_flops) == (real.saved_bytes, real.forward_flops, real.backward_flops)


def test_fake_tensors_measure_the_rebuilt_steps_of_selective_recompute():
    """Blocks that rebuild their cheap steps do it on fake tensors too (``--measure``, the rehearsal)."""
    for dtype in ("fp32", "bf16"):
        real = ms.measure_config(LLAMA_TINY, micro_batch=2, param_dtype=dtype, recompute="selective", fake=False)
        fake = ms.measure_config(LLAMA_TINY, micro_batch=2, param_dtype=dtype, recompute="selective", fake=True)
        assert fake.saved_bytes == real.saved_bytes


def _measure_bf16_model(cfg, *, recompute: str):
    """Saved bytes of one microbatch of 2 with 16-bit compute copies of every weight and a bf16
    residual stream: the model cast to bf16, as FSDP2's MixedPrecisionPolicy gathers it."""
    from llmforge.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(cfg).to(torch.bfloat16)
    model.train()
    caches = ms._recompute_wrap(model, mode=recompute, every=1)
    return ms.run_once(model, micro_batch=2, param_dtype="bf16", vocab=cfg.vocab_size, seq=cfg.seq_len, caches=caches)


@pytest.mark.parametrize("name,recompute", [(n, r) for n in sorted(CONFIGS) for r in ("none", "selective", "full")])
def test_bf16_residual_stream_activations_match_measurement(name, recompute, balanced_routing):
    """The default under bf16 (``precision.fp32_residual=false``): the block inputs recompute
    saves, the norms' inputs and the linears' shared input are bf16; measured with 16-bit
    weights (ZeRO 1-3's gathered copies: the layout below gathers them)."""
    from llmforge.estimate import activations as act
    from llmforge.layout import Layout

    cfg = CONFIGS[name]
    got = _measure_bf16_model(cfg, recompute=recompute)
    shape = shape_from_config(cfg)
    job = dataclasses.replace(_job("bf16"), fp32_residual=False)
    layout = Layout(dp=2, zero=3, micro_batch_size=2, recompute=recompute)
    est = sum(act.layer_bytes(shape, layout, job, i) for i in range(shape.num_layers))
    est += act.embedding_bytes(shape, layout) + act.output_bytes(shape, layout, job)
    assert est == pytest.approx(got.saved_bytes, rel=0.10)
    fp32_residual = dataclasses.replace(job, fp32_residual=True)
    if recompute == "full":  # the block input alone tells the two apart
        blocks = sum(act.layer_bytes(shape, layout, fp32_residual, i) for i in range(shape.num_layers))
        assert blocks == 2 * sum(act.layer_bytes(shape, layout, job, i) for i in range(shape.num_layers))
