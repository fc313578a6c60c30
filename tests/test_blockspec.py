"""The block description (``llmforge.blockspec``) against what is derived from it: the torch
modules' parameters, the tensor-parallel plan and the Hugging Face name table."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from tiny_models import GPT_TINY, LLAMA_TINY  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402

from llmforge.blockspec.block import describe, model_tensors  # noqa: E402
from llmforge.blockspec.dims import dims_of, is_moe_layer  # noqa: E402
from llmforge.checkpoint.hf_names import rules  # noqa: E402
from llmforge.config.schema import ModelConfig, MoEConfig  # noqa: E402
from llmforge.models.gpt import GPT  # noqa: E402
from llmforge.parallel.tensor import _block_plan  # noqa: E402

MOE = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=48, num_shared_experts=1, every=2)
CONFIGS = {
    "gpt": GPT_TINY,
    "gpt-no-bias-untied": dataclasses.replace(GPT_TINY, bias=False, tie_embeddings=False),
    "llama-gqa": LLAMA_TINY,
    "llama-mha-bias": dataclasses.replace(LLAMA_TINY, num_kv_heads=None, bias=True, tie_embeddings=True),
    "moe-swiglu-shared": dataclasses.replace(LLAMA_TINY, num_layers=4, moe=MOE),
    "moe-gelu-bias": dataclasses.replace(GPT_TINY, moe=dataclasses.replace(MOE, num_shared_experts=2, every=1)),
}


def _described(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of the model in registration order, as the description lists them."""
    dims = dims_of(cfg)
    first, last = model_tensors(dims)
    out = [(p.name, p.shape) for p in first]
    for i in range(cfg.num_layers):
        out += [(f"layers.{i}.{p.name}", p.shape) for p in describe(dims, moe=is_moe_layer(dims, i)).params]
    return out + [(p.name, p.shape) for p in last]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_modules_have_the_described_parameters(name):
    cfg = CONFIGS[name]
    with torch.device("meta"):
        model = GPT(cfg)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == _described(cfg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_tensor_parallel_plan_names_the_blocks_modules(name, sequence_parallel):
    cfg = CONFIGS[name]
    dims = dims_of(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    for index, block in model.layers.items():
        spec = describe(dims, moe=is_moe_layer(dims, int(index)))
        plan = _block_plan(spec, seq=Replicate(), sequence_parallel=sequence_parallel, own={})
        for path in plan:
            block.get_submodule(path)  # raises if the plan names a module the block lacks
        linears = {path for path in plan if isinstance(block.get_submodule(path), nn.Linear)}
        assert linears == {x.name for x in spec.linears if x.split in ("col", "row")}


@pytest.mark.parametrize("name", ["gpt", "llama-gqa", "llama-mha-bias"])
def test_every_parameter_has_one_hugging_face_rule(name):
    cfg = CONFIGS[name]
    ours = [n for rule in rules(cfg) for n in rule.ours]
    assert sorted(ours) == sorted(n for n, _ in _described(cfg))
