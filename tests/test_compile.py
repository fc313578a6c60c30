"""Block transforms in one process: recompute and torch.compile change no number."""

from __future__ import annotations

import pytest
import torch

from llmforge.models.gpt import Block
from llmforge.parallel.recompute import CheckpointedModule, RebuiltModule
from llmforge.testing.harness import rank_info, tiny_plan, train_layout
from llmforge.train.build import build_components


def _blocks(plan):
    c = build_components(plan, rank=rank_info(plan, device=torch.device("cpu")), sampler=None)
    return list(c.model_parts[0].layers.values())


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_one_process_applies_recompute_and_trains_the_same(mode):
    plan = tiny_plan(["train.steps=3", f"parallel.recompute={mode}"])
    wrapper = RebuiltModule if mode == "selective" else CheckpointedModule  # an eager dense block rebuilds its cheap steps
    assert all(isinstance(b, wrapper) and isinstance(b, Block) for b in _blocks(plan))
    eager = train_layout(tiny_plan(["train.steps=3"]))
    again = train_layout(plan)
    assert again.losses == pytest.approx(eager.losses, rel=1e-6)


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones():
    plan = tiny_plan(["train.steps=3", "train.compile=true", "model.num_layers=2"])
    blocks = _blocks(plan)
    assert all(b._compiled_call_impl is not None for b in blocks)
    compiled = train_layout(plan)
    eager = train_layout(tiny_plan(["train.steps=3", "model.num_layers=2"]))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    assert compiled.params and set(compiled.params) == set(eager.params)  # names unchanged: no _orig_mod
    for name, value in eager.params.items():
        torch.testing.assert_close(compiled.params[name], value, rtol=1e-4, atol=1e-6)
