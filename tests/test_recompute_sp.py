"""Selective recompute under tensor + sequence parallel keeps what docs/parallelism.md says.

Rank 0 of two over torch's fake process group (collectives return at once, shapes are
real), tiny blocks in bf16 autocast with a 16-bit residual stream: the bytes the blocks
hold after forward, counted by the rehearsal's tracker, against the documented formula
and the estimator."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from llmforge.config.schema import ModelConfig, MoEConfig
from llmforge.estimate.activations import block_activations
from llmforge.estimate.shape import Job, shape_from_config
from llmforge.hardware import get_profile
from llmforge.layout import Layout
from llmforge.models.gpt import GPT
from llmforge.parallel.recompute import apply_recompute
from llmforge.parallel.tensor import apply_tp
from llmforge.rehearse.fake import fake_process_group
from llmforge.rehearse.tracker import PeakTracker

TP, BATCH, SEQ, LAYERS, HIDDEN, HEADS = 2, 2, 32, 2, 64, 4
FP32 = 4


def config(flavour: str) -> ModelConfig:
    llama = flavour == "llama"
    return ModelConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_kv_heads=2 if llama else None,
        ffn_hidden_size=4 * HIDDEN,
        vocab_size=96,
        seq_len=SEQ,
        norm="rmsnorm" if llama else "layernorm",
        activation="swiglu" if llama else "gelu",
        position="rope" if llama else "learned",
        bias=not llama,
        moe=MoEConfig(num_experts=0),
    )


def documented_bytes_per_token(cfg: ModelConfig, *, t: int) -> float:
    """docs/parallelism.md, selective under TP + SP, 16-bit residual and compute (2 bytes):
    the block input, q/k/v, the attention output and its fp32 log-sum-exp, the attention's
    reduce-scattered output, the MLP's first linear (GELU: ffn, SwiGLU: 2 ffn) and its
    reduce-scattered output, all split over t."""
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    kv = (cfg.num_kv_heads or cfg.num_heads) * h // cfg.num_heads
    first = (2 if cfg.activation == "swiglu" else 1) * ffn
    return (2 * h + 2 * (h + 2 * kv) + 2 * h + FP32 * cfg.num_heads + 2 * h + 2 * first + 2 * h) / t


def kept_per_layer_and_token(cfg: ModelConfig, *, mode: str) -> float:
    """Bytes the blocks keep for backward per layer and token on tp rank 0 after one forward."""
    with fake_process_group(rank=0, world_size=TP):
        model = GPT(cfg)
        model.init_weights(seed=3)
        apply_tp(model, tp_mesh=init_device_mesh("cpu", (TP,)), sequence_parallel=True)
        apply_recompute(model, mode=mode)
        rope = (model.rope_cos, model.rope_sin) if model.rope_cos is not None else None
        with torch.autocast("cpu", dtype=torch.bfloat16), PeakTracker(modules=[model]) as tracker:
            weights = tracker.current
            out = torch.randn(BATCH, SEQ // TP, HIDDEN, dtype=torch.bfloat16, requires_grad=True)  # counted: the first block keeps it
            for block in model.layers.values():
                out = block(out, rope)
            kept = tracker.current - weights - out.untyped_storage().nbytes()
        out.float().sum().backward()
    return kept / LAYERS / (BATCH * SEQ)


@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_selective_block_under_tp_and_sp_keeps_the_documented_bytes(flavour):
    """The row-parallel linears' partial sums (whole sequence, full width: 2h bytes a token
    each, 8h/t at t 2), which backward never reads, are not among them."""
    cfg = config(flavour)
    kept = kept_per_layer_and_token(cfg, mode="selective")
    assert kept == pytest.approx(documented_bytes_per_token(cfg, t=TP), abs=1e-9)
    job = Job(global_batch=BATCH, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("cpu"))
    layout = Layout(tp=TP, sequence_parallel=True, recompute="selective", micro_batch_size=BATCH)
    est = block_activations(shape_from_config(cfg), layout, job, moe=False, recompute="selective")
    assert est.per_token == pytest.approx(kept, abs=1e-9)


def test_without_recompute_a_block_keeps_korthikantis_selective_set():
    """Megatron's selective recompute (the attention core only) keeps 34sbh/t bytes a layer under
    TP + SP (Korthikanti et al. 2022), two of them dropout masks; with a fused attention kernel,
    which keeps no score matrix, that is what a block keeps without recompute: 32h/t bytes a token,
    the log-sum-exp and the norms' statistics besides."""
    cfg = config("gpt")
    kept = kept_per_layer_and_token(cfg, mode="none")
    h, t = cfg.hidden_size, TP
    assert 32 * h / t < kept < 1.05 * 32 * h / t
    assert kept == pytest.approx(34 * h / t, rel=0.10)
