"""Document masks, position reset and sliding windows in one process: what a token sees."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from llmforge.errors import UserError
from llmforge.models.gpt import GPT
from llmforge.models.masks import block_mask, dense_mask, document_ids, document_positions, windowed_layer
from llmforge.testing.harness import tiny_plan

EOS = 0


def model_of(overrides):
    plan = tiny_plan(["model.vocab_size=64", "model.num_kv_heads=2"] + overrides)
    model = GPT(plan.config.model)
    model.init_weights(seed=3)
    return model.eval(), plan.config.model


def packed_row(lengths, *, seed=0):
    """One row of documents of these lengths, each ending with the end-of-document token."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(1, 64, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in lengths]
    return torch.cat(docs)[None], docs


def test_document_ids_and_positions_restart_after_each_end_token():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9]])
    docs = document_ids(tokens, eos_id=EOS)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_a_packed_document_computes_what_it_computes_alone(position):
    model, _ = model_of(["model.attention_mask=document", "model.position_reset=true", f"model.position={position}"])
    row, docs = packed_row([5, 11, 3, 13])
    with torch.no_grad():
        packed = model(row, documents=document_ids(row, eos_id=EOS))[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_without_the_mask_documents_see_each_other():
    model, _ = model_of(["model.position_reset=true", "model.position=rope"])
    row, docs = packed_row([5, 11, 3, 13])
    with torch.no_grad():
        packed = model(row, documents=document_ids(row, eos_id=EOS))[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
    torch.testing.assert_close(packed[:5], alone[:5])
    assert not torch.allclose(packed[5:], alone[5:], atol=1e-3)


def test_a_sliding_window_layer_sees_exactly_its_window():
    """One RoPE layer (relative positions): the output at q is that of the last N tokens alone."""
    window = 4
    model, _ = model_of(["model.num_layers=1", "model.position=rope", f"model.sliding_window={window}"])
    tokens = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    documents = torch.zeros_like(tokens, dtype=torch.int32)
    with torch.no_grad():
        out = model(tokens, documents=documents)[0]
        for q in range(window, 20):
            alone = model(tokens[:, q - window + 1 : q + 1])[0, -1]
            torch.testing.assert_close(out[q], alone, rtol=1e-5, atol=1e-5)


def test_window_layers_follow_every_or_the_list():
    _, every2 = model_of(["model.sliding_window=8", "model.sliding_window_every=2"])
    assert [windowed_layer(every2, i) for i in range(4)] == [True, False, True, False]
    _, listed = model_of(["model.sliding_window=8", "model.sliding_window_layers=[1,3]"])
    assert [windowed_layer(listed, i) for i in range(4)] == [False, True, False, True]
    _, off = model_of([])
    assert not any(windowed_layer(off, i) for i in range(4))


def test_plain_causal_attention_builds_no_mask():
    model, _ = model_of([])
    masks = model.attention_masks(positions=None, documents=None, batch=2, length=32, device=torch.device("cpu"))
    assert masks.full is None and masks.windowed is None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flex_block_mask_computes_what_the_dense_mask_computes():
    """Forward only: FlexAttention has no backward on the CPU (CUDA: tests/gpu/test_attention_masks.py)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 48, 8, generator=gen) for _ in range(3))
    tokens = torch.randint(0, 6, (2, 48), generator=gen)
    documents = document_ids(tokens, eos_id=EOS)
    for window in (0, 5):
        dense = dense_mask(q_positions=torch.arange(48), k_len=48, documents=documents, window=window)
        block = block_mask(documents=documents, window=window, length=48, batch=2, device=torch.device("cpu"))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=block), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.attention_mask=packed"], "model.attention_mask"),
        (["model.sliding_window=-1"], "model.sliding_window"),
        (["model.sliding_window=8", "model.sliding_window_every=0"], "model.sliding_window_every"),
        (["model.sliding_window=8", "model.sliding_window_layers=[0,7]"], "model.sliding_window_layers"),
    ],
)
def test_bad_attention_settings_are_refused_by_key(overrides, key):
    with pytest.raises(UserError) as info:
        tiny_plan(overrides)
    assert key in [p.key for p in info.value.problems]
