"""Muon (optim.name=muon): the orthogonalisation, which parameters it takes, its plan
rules, every layout computing one process's numbers (one torchrun, several layouts),
and an exact resume of its sharded momentum."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gloo_runs import run_harness

from llmforge.testing.harness import tiny_plan, train_layout

MUON = ["optim.name=muon"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=48", "model.moe.num_shared_experts=1", "model.seq_len=16"]
# Sharded over one mesh dimension (gathered to an owner rank), whole on each rank (pipeline
# stages, experts split over ep), and the batch-of-experts Newton-Schulz.
WORLD2 = {
    "dp2_zero1": ["parallel.dp=2", "parallel.zero=1"],
    "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"],
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2"],
    "moe_ep2": MOE + ["parallel.dp=2", "parallel.ep=2"],
}


def test_newton_schulz_orthogonalises_each_matrix_of_a_batch():
    from llmforge.parallel.orthogonalize import newton_schulz

    x = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(0))
    y = newton_schulz(x, steps=5)
    assert y.shape == x.shape
    for i in range(3):
        singular = torch.linalg.svdvals(y[i])
        assert singular.min() > 0.5 and singular.max() < 1.3  # Keller Jordan's quintic: about U V^T
        torch.testing.assert_close(newton_schulz(x[i].T, steps=5), y[i].T)  # tall and wide alike


def test_one_muon_update_is_the_hand_computed_newton_schulz_result_times_moonshots_scale():
    """Every layout is compared with one process's Muon; this holds that one to the formula:
    W -= lr * 0.2 * sqrt(max(rows, cols)) * NS5(g), with Keller Jordan's quintic written out here."""
    from llmforge.config.schema import OptimConfig
    from llmforge.train.muon import Muon

    grad = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weight = torch.nn.Parameter(torch.zeros(4, 16, dtype=torch.float64))
    weight.grad = grad.clone()
    optimizer = Muon([{"params": [weight], "muon": True, "weight_decay": 0.0, "lr": 0.1}], optim=OptimConfig(), lr=0.1)
    optimizer.step()
    y = grad / grad.norm()  # the first Nesterov look-ahead is (1 + momentum) * grad: the same direction
    for _ in range(5):
        gram = y @ y.T
        y = 3.4445 * y + (-4.7750 * gram + 2.0315 * gram @ gram) @ y
    torch.testing.assert_close(weight.detach(), -0.1 * 0.2 * 16**0.5 * y, rtol=1e-4, atol=1e-6)  # fp32 iterations


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    from llmforge.models.gpt import GPT
    from llmforge.train.optim import build_optimizer

    plan = tiny_plan(MUON + MOE + ["model.tie_embeddings=false", "optim.adamw_lr=3e-3"])
    model = GPT(plan.config.model)
    optimizer = build_optimizer(model, optim=plan.config.optim, lr=plan.config.train.lr)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    assert (
        "layers.0.attn.qkv_proj.weight" in muon and "layers.0.mlp.experts.w_up" in muon and "layers.0.mlp.shared.down_proj.weight" in muon
    )
    assert {"embed.weight", "head.weight", "layers.0.attn_norm.weight", "layers.0.mlp.router.weight", "norm.weight"} <= adamw
    assert not muon & adamw and len(muon | adamw) == len(names)
    assert {g["lr"] for g in optimizer.param_groups if not g["muon"]} == {3e-3}
    assert {g["lr"] for g in optimizer.param_groups if g["muon"]} == {plan.config.train.lr}


def test_plan_refuses_an_unknown_optimizer_and_muon_with_offload():
    from llmforge.errors import UserError

    with pytest.raises(UserError, match="optim.name"):
        tiny_plan(["optim.name=sgd"])
    with pytest.raises(UserError, match="parallel.offload"):
        tiny_plan(MUON + ["parallel.dp=2", "parallel.zero=3", "parallel.offload=states"])


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    return run_harness(tmp_path_factory.mktemp("muon"), {"base": MUON, "layouts": WORLD2}, nproc=2)


@pytest.fixture(scope="module")
def references() -> dict:
    return {"dense": train_layout(tiny_plan(MUON)), "moe": train_layout(tiny_plan(MUON + MOE))}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(WORLD2))
def test_sharded_muon_matches_one_process(layout, layouts, references):
    ref = references["moe" if layout.startswith("moe") else "dense"]
    got = layouts[layout]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], ref.losses, strict=False)) < 1e-5
    for name, value in ref.params.items():
        rel = float((got["params"][name] - value).norm() / value.norm())
        assert rel < 1e-5, f"{name}: relative difference {rel:.2e}"


@pytest.mark.slow
def test_muon_resumes_exactly_and_reshards(tmp_path, small_data):
    """ZeRO-3 Muon saves at step 3; resuming it on ZeRO-3 repeats steps 4-6 bit for bit,
    on tp2 (the momentum resharded) to fp32 tolerance."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_resume_distributed import TINY, launch, losses

    base = [*TINY, *small_data, *MUON]
    z = tmp_path / "zero3"
    phases = {
        "zero3": {"overrides": ["parallel.dp=2", "parallel.zero=3"], "run_dir": str(z)},
        "zero3_resumed": {"resume": str(z / "checkpoints/step_3"), "overrides": [], "run_dir": str(tmp_path / "r1")},
        "tp2_from_zero3": {
            "resume": str(z / "checkpoints/step_3"),
            "overrides": ["parallel.dp=1", "parallel.zero=0", "parallel.tp=2"],
            "run_dir": str(tmp_path / "r2"),
        },
    }
    launch(tmp_path, nproc=2, base=base, phases=phases)
    full, resumed, resharded = losses(z), losses(tmp_path / "r1"), losses(tmp_path / "r2")
    assert [resumed[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]
    assert all(abs(resharded[s] - full[s]) / full[s] < 1e-5 for s in (4, 5, 6)), (resharded, full)


def test_estimate_counts_one_momentum_buffer_and_the_newton_schulz_step():
    from llmforge.estimate.core import estimate
    from llmforge.estimate.inventory import inventory
    from llmforge.estimate.muon import step_seconds
    from llmforge.estimate.shape import Job, Shape
    from llmforge.hardware import get_profile
    from llmforge.layout import Layout

    shape = Shape(num_layers=8, hidden=2048, heads=16, kv_heads=16, ffn=8192, vocab=32000, seq=2048)
    adamw = Job(global_batch=64, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"))
    muon = Job(global_batch=64, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"), optimizer="muon")
    layout = Layout(dp=8, zero=1)
    a, m = estimate(shape, layout, adamw), estimate(shape, layout, muon)
    blocks = 8 * (4 * 2048 * 2048 + 2 * 2048 * 8192)
    assert m.worst.optimizer == pytest.approx(a.worst.optimizer - 4 * blocks / 8, rel=1e-3)  # 4 bytes less per block matrix element
    assert m.parts["optimizer"] > a.parts["optimizer"]
    # ZeRO over 8 ranks: each orthogonalises an eighth, after a gather; held whole (ZeRO 0), all of them
    inv = inventory(shape, layout)
    sharded, whole = step_seconds(inv, muon, 0), step_seconds(inventory(shape, Layout(dp=8)), muon, 0)
    assert whole / 8 < sharded < whole
    assert step_seconds(inv, adamw, 0) == 0
    assert step_seconds(inv, replace(muon, muon_ns_dtype="bf16"), 0) < sharded  # bf16 matmuls are faster


@pytest.mark.parametrize(
    "layout", [["parallel=dp2", "parallel.zero=1"], ["parallel=dp2tp2", "parallel.zero=3"]], ids=["dp2_zero1", "dp2tp2_zero3"]
)
def test_estimated_muon_state_is_what_rank_0_holds(layout):
    """Rank 0's real program on a fake process group: its optimizer-state bytes against the estimate."""
    from llmforge.config.compose import compose
    from llmforge.estimate.inventory import inventory
    from llmforge.estimate.memory import stage_memory
    from llmforge.estimate.shape import from_plan
    from llmforge.plan import RunPlan
    from llmforge.train.footprint import measure_step

    small = ["model.num_layers=2", "model.vocab_size=512", "model.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8"]
    plan = RunPlan.build(compose(layout + small + ["optim=muon", "precision=bf16"]))
    (_, _, states), _ = measure_step(plan)
    shape, lay, job = from_plan(plan)
    assert stage_memory(inventory(shape, lay), job, 0, plan.microbatches).optimizer == pytest.approx(states, rel=1e-9)


def test_estimate_gathers_experts_that_zero_cuts_inside_each_expert(monkeypatch):
    """dp 8, ep 2: four ranks share each rank's local experts. With two local experts FSDP2 cuts
    each expert on dim 1, so Muon gathers every rank's stack to one owner
    (llmforge.parallel.orthogonalize) and scatters it back; with four each rank holds one whole."""
    from llmforge.estimate import muon as muon_estimate
    from llmforge.estimate.inventory import inventory
    from llmforge.estimate.shape import Job, Shape
    from llmforge.hardware import get_profile
    from llmforge.layout import Layout

    monkeypatch.setattr(muon_estimate, "is_muon", lambda t: t.expert and len(t.shape) == 3)  # the experts alone
    muon = Job(global_batch=64, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"), optimizer="muon")
    free = replace(muon, profile=replace(muon.profile, intra_node_bandwidth=1e18, inter_node_bandwidth=1e18, comm_latency_us=0.0))

    def seconds(job: Job, *, experts: int) -> float:
        shape = Shape(num_layers=2, hidden=1024, heads=8, kv_heads=8, ffn=2816, vocab=32000, seq=2048, num_experts=experts, top_k=2)
        return muon_estimate.step_seconds(inventory(shape, Layout(dp=8, ep=2, zero=1)), job, 0)

    assert seconds(muon, experts=4) > seconds(free, experts=4)  # the gather and scatter of the cut experts
    assert seconds(muon, experts=8) == seconds(free, experts=8)  # whole experts: no traffic
    # the owners share the group's Newton-Schulz work: half an expert per rank, against one whole
    assert seconds(free, experts=4) == pytest.approx(seconds(free, experts=8) / 2)
