"""The estimator's attention FLOPs under a document mask or sliding window, against
torch's flop counter (torch.utils.flop_counter) on the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from llmforge.estimate.attention import attention_cost, document_fraction, mask_fraction, window_fraction
from llmforge.estimate.flops import block_flops
from llmforge.estimate.shape import shape_from_config
from llmforge.models.gpt import GPT
from llmforge.testing.harness import tiny_plan

SEQ = 64
LENGTHS = [10, 50, 7, 30, 90, 3, 40, 64, 1, 22, 70, 5, 33, 12, 80, 4]


def attention_matmul_flops(model: GPT, pieces) -> int:
    """What the flop counter counts in attention's batched matmuls (scores and weighted sum)
    over ``pieces`` run one by one (SDPA's math path: the CPU's fused kernel is not counted)."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        for piece in pieces:
            model(piece[None])
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if "bmm" in str(op))


def test_document_attention_flops_equal_the_counter_over_each_document_alone():
    config = tiny_plan(["model.attention_mask=document", f"model.seq_len={SEQ}", "model.num_kv_heads=2"]).config.model
    ends = np.cumsum(LENGTHS)
    windows = (int(ends[-1]) - 1) // SEQ
    tokens = torch.randint(1, 64, (int(ends[-1]),), generator=torch.Generator().manual_seed(0))
    cuts = sorted(set(ends[ends < windows * SEQ].tolist()) | set(range(0, windows * SEQ + 1, SEQ)))
    pieces = [tokens[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]  # each window's documents, alone
    model = GPT(config).eval()
    counted = attention_matmul_flops(model, pieces)

    shape = shape_from_config(config, attention_fraction=document_fraction(ends, seq=SEQ))
    estimated = block_flops(shape, moe=False).attention * windows * SEQ * config.num_layers
    assert shape.attention_fraction < 0.7
    assert estimated == pytest.approx(counted, rel=1e-9)
    whole = attention_matmul_flops(model, [tokens[i * SEQ : (i + 1) * SEQ] for i in range(windows)])
    assert block_flops(shape_from_config(config), moe=False).attention * windows * SEQ * config.num_layers == pytest.approx(whole, rel=1e-9)


def test_a_window_keeps_its_share_and_layers_without_it_keep_everything():
    assert window_fraction(seq=8, window=8) == 1.0
    assert window_fraction(seq=8, window=1) == 8 / 64  # the diagonal only
    # every second layer windowed: the mean of the windowed and the full layers
    config = tiny_plan([f"model.seq_len={SEQ}", "model.sliding_window=16", "model.sliding_window_every=2"]).config.model
    assert mask_fraction(config, streams=None) == pytest.approx((window_fraction(seq=SEQ, window=16) + 1) / 2)


def test_without_prepared_data_a_document_mask_saves_nothing_and_says_so(tmp_path):
    from llmforge.data.prepare import document_ends_for

    plan = tiny_plan(["model.attention_mask=document", f"data.cache_dir={tmp_path}"])
    assert document_ends_for(plan.config, vocab_size=plan.data_vocab_size) is None
    cost = attention_cost(plan.config, documents=None)
    assert cost.fraction == 1.0 and "not prepared" in cost.note


def test_with_prepared_data_the_command_passes_its_document_lengths(small_data):
    from llmforge.commands.plans import plan_documents, plan_estimate
    from llmforge.data.prepare import prepare
    from llmforge.estimate.core import estimate_plan

    plan = tiny_plan(["model.attention_mask=document", "model.seq_len=256", "model.vocab_size=4096"] + list(small_data))
    before = estimate_plan(plan)
    prepare(data=plan.config.data, vocab_size=plan.data_vocab_size, seed=0)
    documents = plan_documents(plan)
    assert documents is not None
    [(ends, _)] = documents
    cost = attention_cost(plan.config, documents=documents)
    assert cost.fraction == pytest.approx(document_fraction(ends, seq=256)) and cost.fraction < 1.0
    assert "prepared data" in cost.note
    # the estimator reads no files: the same inputs give the same numbers after the data is prepared
    assert estimate_plan(plan) == before and before.shape.attention_fraction == 1.0
    assert plan_estimate(plan).shape.attention_fraction == pytest.approx(cost.fraction)
