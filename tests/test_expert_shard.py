"""ZeRO shards expert weights over the ranks holding the same experts, whatever the local
expert count: on dim 0 when the local experts split evenly over that group, otherwise on a
later dimension (``llmforge.layout.expert_shard_dim``), so no rank keeps a whole padded
expert. The backend (FSDP2, llmforge.parallel.data) and the estimator's inventory follow the
one rule; this file holds each to it and the sharded run to one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_runs import run_harness
from torch.testing._internal.distributed.fake_pg import FakeStore

from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.estimate.core import estimate
from llmforge.estimate.inventory import inventory
from llmforge.estimate.search import _recompute_modes
from llmforge.estimate.shape import from_plan
from llmforge.hardware import GIB
from llmforge.layout import Layout, expert_shard_dim
from llmforge.parallel.dtensor import local
from llmforge.parallel.expert import expert_parameters
from llmforge.parallel.mesh import build_mesh
from llmforge.plan import RunPlan
from llmforge.testing.harness import tiny_plan, train_layout
from llmforge.train.build import build_parts


@pytest.mark.parametrize(
    "shape,group,dim",
    [
        ((1, 4096, 14336), 4, 1),  # Mixtral 8x7B at ep 8 over 4 replicas: a quarter of the one expert
        ((2, 32, 48), 2, 0),  # local experts split evenly: whole experts
        ((3, 6, 10), 2, 1),
        ((1, 3, 10), 2, 2),
        ((1, 3, 5), 2, 0),  # nothing splits evenly: dim 0, padded
        ((1, 32, 48), 1, 0),
    ],
)
def test_the_shard_dimension_splits_evenly_where_it_can(shape, group, dim):
    assert expert_shard_dim(shape, group=group) == dim


#: moe-tiny (hidden 128, expert ffn 192) with more replicas of each expert group than local experts.
MOE_LAYOUTS = [
    ["model.moe.num_experts=2", "parallel.dp=8", "parallel.ep=2", "parallel.zero=1"],  # 1 local expert over 4
    ["model.moe.num_experts=2", "parallel.dp=4", "parallel.ep=2", "parallel.zero=3"],  # 1 local expert over 2
    ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"],  # 2 local experts over 2: dim 0
]


def _allocated(plan: RunPlan, rank: int) -> tuple[int, list[tuple[int, int]]]:
    """Rank ``rank`` on the fake group: elements of every storage its parameters hold (FSDP2's
    padded shards), and (allocated, whole) elements of each expert weight."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        mesh = build_mesh(plan.layout, device_type="cpu", timeout_s=plan.config.cluster.timeout_s)
        parts, _ = build_parts(plan, mesh=mesh, device=torch.device("cpu"))
        storages = {
            local(p).untyped_storage()._cdata: local(p).untyped_storage().nbytes() // 4 for part in parts for p in part.parameters()
        }
        experts = [(local(p).untyped_storage().nbytes() // 4, p.numel()) for part in parts for p in expert_parameters(part)]
        return sum(storages.values()), experts
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overrides", MOE_LAYOUTS, ids=[" ".join(o) for o in MOE_LAYOUTS])
def test_fsdp2_allocates_the_estimated_expert_shards_on_every_rank(overrides):
    plan = RunPlan.build(compose(["recipe=moe-tiny", *overrides, "train.micro_batch_size=2", "train.global_batch_size=16"]))
    shape, layout, _ = from_plan(plan)
    estimated = inventory(shape, layout).stages[0].shard
    replicas = plan.dp // layout.ep
    for rank in range(plan.world_size):
        total, experts = _allocated(plan, rank)
        assert total == estimated, rank
        assert experts and all(held * layout.ep * replicas == whole for held, whole in experts), (rank, experts)


def test_the_mixtral_recipe_fits_its_h100s_with_headroom():
    """ep 8 over 64 data-parallel ranks (each rank holds an eighth of its one expert per layer), full recompute."""
    plan = RunPlan.build(compose(["recipe=mixtral-8x7b"]))
    shape, layout, job = from_plan(plan)
    assert (layout.ep, layout.tp, plan.dp, layout.zero, layout.recompute) == (8, 1, 64, 1, "full")
    est = estimate(shape, layout, job)
    assert est.fits and est.headroom > 8 * GIB


def test_selective_recompute_with_expert_units_is_refused_by_name():
    with pytest.raises(UserError, match="parallel.recompute") as info:
        RunPlan.build(compose(["recipe=mixtral-8x7b", "parallel.recompute=selective"]))
    assert "parallel.recompute=full" in info.value.message()
    RunPlan.build(compose(["recipe=mixtral-8x7b", "parallel.recompute=selective", "parallel.zero=0"]))  # no expert units


def test_the_search_tries_selective_recompute_only_where_it_runs():
    assert _recompute_modes(Layout(dp=2, ep=2, zero=1)) == ("none", "full")
    assert _recompute_modes(Layout(dp=2, ep=2, zero=0)) == ("none", "selective", "full")
    assert _recompute_modes(Layout(dp=2, zero=3)) == ("none", "selective", "full")


# The tiny test model with 2 experts top-2 over ep 2: one local expert, sharded over 2 replicas.
TWO_EXPERTS = [
    "model.moe.num_experts=2",
    "model.moe.top_k=2",
    "model.moe.ffn_hidden_size=48",
    "model.moe.num_shared_experts=1",
    "model.moe.aux_loss_coef=0.05",
    "model.moe.z_loss_coef=0.01",
    "model.seq_len=16",
]
SHARDED = {
    # as the mixtral-8x7b recipe runs: ZeRO-1, full recompute
    "dp4_ep2_zero1_full": TWO_EXPERTS + ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1", "parallel.recompute=full"],
    "dp4_ep2_zero3": TWO_EXPERTS + ["parallel.dp=4", "parallel.ep=2", "parallel.zero=3"],
}


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict:
    return run_harness(tmp_path_factory.mktemp("expert_shard"), {"base": [], "layouts": SHARDED}, nproc=4)


@pytest.fixture(scope="module")
def one_process():
    return train_layout(tiny_plan(TWO_EXPERTS))


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SHARDED))
def test_experts_sharded_within_one_expert_match_one_process(layout, sharded_runs, one_process):
    got, ref = sharded_runs[layout], one_process
    assert _max_rel(got["losses"], ref.losses) < 1e-5
    assert _max_rel(got["grad_norms"], ref.grad_norms) < 1e-5
    for name, value in ref.params.items():
        assert float((got["params"][name] - value).norm() / value.norm()) < 1e-5, name
    held = {n: k for n, k in got["local_numel"].items() if ".mlp.experts." in n}
    # rank 0 holds half of its one expert (a whole padded expert on dim 0 would be numel / 2)
    assert held and all(4 * k == ref.params[n].numel() for n, k in held.items()), held
