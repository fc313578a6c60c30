"""Fused projections: the unfused model's values, whole heads on every tensor-parallel rank,
and checkpoints of unfused models (exported, refused on resume)."""

from __future__ import annotations

import pytest
import torch

from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.models.fused import FUSED, fuse, fuse_saved, layout_of, parts_of, unfuse
from llmforge.models.gpt import GPT, initial_value

LLAMA = [
    "model.norm=rmsnorm",
    "model.activation=swiglu",
    "model.position=rope",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=384",
    "model.bias=true",
]


def _model(extra=()):
    return compose(["logging=quiet", *LLAMA, *extra]).model


@pytest.mark.parametrize("name", ["layers.1.attn.qkv_proj.weight", "layers.1.attn.qkv_proj.bias", "layers.0.mlp.gate_up_proj.weight"])
def test_a_fused_initial_value_holds_the_unfused_models_values(name):
    m = _model()
    shape = GPT(m).state_dict()[name].shape
    sizes, groups = layout_of(m, name=name, rows=shape[0])
    parts = unfuse(initial_value(m, name=name, shape=shape, seed=7), sizes=sizes, groups=groups)
    for part, value in zip(parts_of(name), parts, strict=False):
        assert torch.equal(value, initial_value(m, name=part, shape=value.shape, seed=7)), part


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_tensor_parallel_rank_holds_whole_heads_and_matching_gate_up_rows(tp):
    """Rank r's contiguous chunk of the fused weight (Shard(0)) is, part by part, rank r's
    chunk of q, k, v (its q heads and the k/v heads of their groups), and of gate and up."""
    m = _model()
    for linear, rows in (("attn.qkv_proj", (8 + 2 * 4) * 16), ("mlp.gate_up_proj", 2 * 384)):
        name = f"layers.0.{linear}.weight"
        sizes, groups = layout_of(m, name=name, rows=rows)
        parts = [torch.arange(size, dtype=torch.float32) + 1000 * i for i, size in enumerate(sizes)]
        chunks = fuse(parts, groups=groups).chunk(tp)
        for rank, chunk in enumerate(chunks):
            local = unfuse(chunk, sizes=[s // tp for s in sizes], groups=groups // tp)
            for part, mine in zip(parts, local, strict=False):
                assert torch.equal(mine, part.chunk(tp)[rank]), (linear, tp, rank)


def test_the_attention_forward_reads_q_k_v_from_the_fused_output():
    """The fused model's attention equals q, k and v computed from the parts' weights."""
    m = _model(["model.bias=false"])
    model = GPT(m)
    model.init_weights(seed=3)
    attn, x = model.layers["0"].attn, torch.randn(2, 5, m.hidden_size)
    weight = attn.qkv_proj.weight.detach()
    q_w, k_w, v_w = unfuse(weight, sizes=layout_of(m, name="attn.qkv_proj.weight", rows=weight.shape[0])[0], groups=4)
    q, k, v = attn.project(x, None)
    assert torch.allclose(q, (x @ q_w.t()).view(2, 5, 8, 16).transpose(1, 2), atol=1e-6)
    assert torch.allclose(k, (x @ k_w.t()).view(2, 5, 4, 16).transpose(1, 2), atol=1e-6)
    assert torch.allclose(v, (x @ v_w.t()).view(2, 5, 4, 16).transpose(1, 2), atol=1e-6)


def test_weights_saved_unfused_are_fused_by_name():
    m = _model()
    fused = GPT(m).state_dict()
    unfused = {}
    for name, value in fused.items():
        parts = parts_of(name)
        if parts is None:
            unfused[name] = value
        else:
            sizes, groups = layout_of(m, name=name, rows=value.shape[0])
            unfused.update(zip(parts, unfuse(value, sizes=sizes, groups=groups), strict=False))
    assert any(".q_proj." in n for n in unfused) and any(".gate_proj." in n for n in unfused)
    back = fuse_saved(unfused, m)
    assert set(back) == set(fused) and all(torch.equal(back[k], fused[k]) for k in fused)
    gelu = compose(["logging=quiet"]).model
    plain = GPT(gelu).state_dict()
    assert fuse_saved(plain, gelu).keys() == plain.keys()  # a GELU MLP's up_proj is not a part of anything


def test_resuming_a_checkpoint_of_an_unfused_model_is_refused_with_the_way_out(tmp_path):
    from llmforge.checkpoint.store import refuse_unfused

    saved = {f"model.layers.0.attn.{p}.weight" for p in FUSED["qkv_proj"]} | {"model.embed.weight", "optim.step"}
    with pytest.raises(UserError, match="saved before llmforge fused its projections") as info:
        refuse_unfused(tmp_path, saved)
    assert "model.init_from" in str(info.value.problems[0].fix) and "llmforge export" in str(info.value.problems[0].fix)
    refuse_unfused(tmp_path, {"model.layers.0.attn.qkv_proj.weight", "model.layers.0.mlp.up_proj.weight"})
