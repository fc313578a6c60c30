"""HSDP plan rules: parallel.dp_replicate splits ZeRO's data-parallel group into replicas."""

from __future__ import annotations

import pytest

from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.plan import RunPlan


def problems_of(*overrides: str) -> str:
    with pytest.raises(UserError) as info:
        RunPlan.build(compose(list(overrides)))
    return info.value.message()


def test_the_hsdp_preset_replicates_once_per_node():
    plan = RunPlan.build(compose(["recipe=llama-8b", "parallel=hsdp", "cluster=h100-node", "cluster.nodes=4"]))
    assert (plan.dp, plan.layout.dp_replicate, plan.layout.dp_shard, plan.config.parallel.zero) == (32, 4, 8, 3)
    assert str(plan.layout) == "hsdp4x8"


def test_hsdp_rules_name_the_key_and_the_fix():
    text = problems_of("parallel=dp4", "parallel.dp_replicate=2")
    assert "parallel.dp_replicate = 2" in text and "parallel.zero=3" in text
    text = problems_of("parallel=dp4", "parallel.zero=3", "parallel.dp_replicate=3")
    assert "does not divide the data-parallel size dp=4" in text
    text = problems_of("parallel.dp=2", "parallel.cp=2", "parallel.zero=3", "parallel.dp_replicate=2")
    assert "parallel.cp = 2" in text and "not combined" in text
    assert "parallel.dp_replicate = 0" in problems_of("parallel.dp_replicate=0")
