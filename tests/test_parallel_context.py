"""Context parallelism: load-balanced sequence sharding, plan rules and the layouts
the plan refuses because the backend cannot run them (the numerical equivalence is in tests/test_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from llmforge.errors import UserError
from llmforge.parallel.context import cp_positions
from llmforge.testing.harness import tiny_plan


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_hold_every_position_once_with_equal_causal_work(cp):
    held = [cp_positions(seq_len=32, cp_rank=r, cp=cp) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(32))
    # Causal work of a query at position p is p + 1 keys: the same on every rank.
    work = {int((h + 1).sum()) for h in held}
    assert len(work) == 1


def test_rank_holds_chunk_r_and_its_mirror():
    assert cp_positions(seq_len=8, cp_rank=0, cp=2).tolist() == [0, 1, 6, 7]
    assert cp_positions(seq_len=8, cp_rank=1, cp=2).tolist() == [2, 3, 4, 5]


def test_plan_needs_seq_len_divisible_by_twice_cp():
    with pytest.raises(UserError) as info:
        tiny_plan(["parallel.cp=2", "model.seq_len=30"])
    assert "model.seq_len = 30: not a multiple of 4" in info.value.message() and "parallel.cp=2" in info.value.message()
    assert tiny_plan(["model.seq_len=31"]).config.model.seq_len == 31  # without context parallelism any length works


def test_context_parallel_layouts_are_planned():
    assert tiny_plan(["parallel.cp=2", "parallel.tp=2", "parallel.zero=3"]).layout.cp == 2


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["parallel.cp=2", "parallel.pp=2"], "parallel.pp"),
        (["parallel.cp=2", "model.moe.num_experts=4", "model.moe.top_k=2"], "model.moe.num_experts"),
    ],
)
def test_unsupported_context_parallel_combinations_are_refused_by_name(overrides, key):
    with pytest.raises(UserError) as info:
        tiny_plan(overrides)
    assert [p.key for p in info.value.problems] == ["parallel.cp"]
    assert key in info.value.problems[0].rule
