"""16-bit compute keeps the residual stream in the compute dtype, as torchtitan and
Megatron run it, and in fp32 with precision.fp32_residual=true; the loss is fp32.
(Layouts against one process: tests/test_parallel.py, MIXED.)"""

from __future__ import annotations

import pytest
import torch

from llmforge.models.layers import LayerNorm, RMSNorm
from llmforge.testing.harness import tiny_plan, train_layout

ONE_STEP = ["train.steps=1", "parallel.recompute=full"]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["precision.param_dtype=bf16"], torch.bfloat16),
        (["precision.param_dtype=fp16"], torch.float16),
        (["precision.param_dtype=bf16", "precision.fp32_residual=true"], torch.float32),
        (["precision.param_dtype=bf16", "model.norm=rmsnorm", "model.activation=swiglu", "model.position=rope"], torch.bfloat16),
        ([], torch.float32),
    ],
)
def test_blocks_receive_and_return_the_residual_stream_in_its_dtype(overrides, expected, device):
    """What reaches each block (before any hook casts it: the embedding's output) and what
    it returns (after its residual adds), and the loss, in one process under full recompute."""
    (dtypes,) = train_layout(tiny_plan(ONE_STEP + overrides), device=torch.device(device)).dtypes
    assert dtypes["block_inputs"] == dtypes["block_outputs"] == [str(expected)]
    assert dtypes["losses"] == ["torch.float32"]


@pytest.mark.parametrize("layout", [[], ["parallel.dp=2", "parallel.zero=3"]], ids=["one-process", "dp2-zero3"])
def test_full_recompute_keeps_the_block_inputs_in_bf16(layout):
    """What one microbatch saves for backward under full recompute (rank 0, the backend's
    own components): every block's input in bf16 by default, half its fp32 bytes."""
    from llmforge.train.footprint import measure_step

    saved = {}
    for fp32_residual in (False, True):
        plan = tiny_plan(
            layout + ["precision.param_dtype=bf16", "parallel.recompute=full", f"precision.fp32_residual={str(fp32_residual).lower()}"]
        )
        saved[fp32_residual] = measure_step(plan)[1]
    m = plan.config.model
    block_inputs = m.num_layers * plan.config.train.micro_batch_size * m.seq_len * m.hidden_size
    assert saved[True] - saved[False] >= 2 * block_inputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_compute_in_their_input_dtype_under_autocast(norm, dtype, device):
    """The stream's dtype in and out, and no fp32 copy of a 16-bit input kept for backward
    (CUDA's autocast would run a norm in fp32); fp32 inputs as before."""
    module = norm(32).to(device)
    x = torch.randn(2, 4, 32, device=device, dtype=dtype, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast(device, dtype=torch.bfloat16):
            out = module(x)
    assert out.dtype == dtype
    if norm is LayerNorm or device == "cuda":  # torch's CPU rms_norm is a composite that keeps fp32 temporaries
        assert {t.dtype for t in saved if t.shape == x.shape} == {dtype}
    reference = module(x.detach().float())
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 0)
