"""The estimator's memory-bound ops held to counts derived by hand from what each kernel reads
and writes per token (c bytes per element in the compute dtype, 4 in the fp32 residual stream):
an eager block's activation and norm, and a compiled block's fused regions. The eager kernel
counts are also held to the profiled model (tests/test_kernel_count.py); a compiled block's are
held here only, as no CPU run shows a GPU's fused kernels."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import GPT_TINY, LLAMA_TINY

from llmforge.blockspec import costs
from llmforge.blockspec.block import describe
from llmforge.blockspec.dims import dims_of

C = 2  # bf16


def ops(config, *, compiled: bool, tp: int = 1) -> dict[str, costs.Op]:
    d = dims_of(config)
    block = describe(d)
    found = costs.compiled_ops(block, d, tp=tp, sp=1, c=C) if compiled else costs.eager_ops(block, d, tp=tp, sp=1, c=C, mixed=True)
    return {o.name: o for o in found}


@pytest.mark.parametrize("tp", [1, 2])
def test_an_eager_gelu_reads_and_writes_its_columns_once_forward_and_three_times_backward(tp):
    f = GPT_TINY.ffn_hidden_size / tp  # this rank's MLP columns
    gelu = ops(GPT_TINY, compiled=False, tp=tp)["mlp gelu"]
    assert (gelu.fwd_kernels, gelu.bwd_kernels) == (1, 1)
    assert gelu.fwd_bytes == C * f + C * f  # read the up projection's output, write the activation
    assert gelu.bwd_bytes == 3 * C * f  # read the gradient and the saved input, write the input's gradient


def test_an_eager_swiglu_and_norm_move_what_their_kernels_touch():
    f, h = LLAMA_TINY.ffn_hidden_size, LLAMA_TINY.hidden_size
    swiglu = ops(LLAMA_TINY, compiled=False)["mlp swiglu"]
    assert (swiglu.fwd_kernels, swiglu.bwd_kernels) == (2, 3)  # silu, product; the product's two gradients, silu's
    assert swiglu.fwd_bytes == 2 * C * f + 3 * C * f  # silu(gate): 1 in, 1 out; its product with up: 2 in, 1 out
    assert swiglu.bwd_bytes == 3 * (3 * C * f)  # three kernels of 2 in, 1 out
    norm = ops(LLAMA_TINY, compiled=False)["norm"]
    assert (norm.count, norm.fwd_kernels, norm.bwd_kernels) == (2, 1, 2) and norm.fwd_bytes == 4 * h + 4 * h  # fp32 in and out


@pytest.mark.parametrize(
    ("config", "kernels"),
    [
        # norm 1; residual add with norm 2; residual add; activation; (bias gradients) or (rope and repeat)
        (
            GPT_TINY,
            {"norm 1 region": (1, 2), "residual add, norm 2 and its cast": (1, 2), "residual add": (1, 2), "activation": (1, 1)}
            | {"bias gradients": (0, 3)},
        ),
        (
            LLAMA_TINY,
            {"norm 1 region": (1, 2), "residual add, norm 2 and its cast": (1, 2), "residual add": (1, 2), "activation": (1, 1)}
            | {"rope and repeat": (1, 1)},
        ),
    ],
)
def test_a_compiled_block_runs_one_fused_kernel_per_memory_bound_chain(config, kernels):
    found = ops(config, compiled=True)
    assert {name: (o.fwd_kernels, o.bwd_kernels) for name, o in found.items()} == kernels
    fwd_kernels, bwd_kernels = costs.totals(list(found.values()))[1::2]
    assert (fwd_kernels, bwd_kernels) == tuple(map(sum, zip(*kernels.values(), strict=True)))


@pytest.mark.parametrize("config", [GPT_TINY, LLAMA_TINY, dataclasses.replace(GPT_TINY, ffn_hidden_size=96)])
def test_a_compiled_activation_reads_its_inputs_and_writes_its_output_once(config):
    mats = 2 if config.activation == "swiglu" else 1  # gate and up, or up
    f = config.ffn_hidden_size
    region = ops(config, compiled=True)["activation"]
    assert region.fwd_bytes == mats * C * f + C * f
    assert region.bwd_bytes == (mats * C * f + C * f) + mats * C * f  # read the gradient and the inputs, write the inputs' gradients
