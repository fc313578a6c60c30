"""Per-rank parameter and optimizer-state bytes: the estimate against the real backend.

Every rank of each layout is built in this one process on torch's fake process
group (collectives do nothing, shapes and sharding are real), with the backend's
own ``build_parts``; AdamW then takes one step on zero gradients so its states exist.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import contextlib  # noqa: E402

from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from llmforge.config.compose import compose  # noqa: E402
from llmforge.estimate.inventory import inventory  # noqa: E402
from llmforge.estimate.memory import model_states  # noqa: E402
from llmforge.estimate.shape import from_plan  # noqa: E402
from llmforge.plan import RunPlan  # noqa: E402

LAYOUTS = [
    ["parallel=dp2"],
    ["parallel=dp2", "parallel.zero=1"],
    ["parallel=dp2", "parallel.zero=2"],
    ["parallel=dp4", "parallel.zero=3"],
    ["parallel=dp4", "parallel.zero=3", "parallel.dp_replicate=2"],
    ["parallel=tp2"],
    ["parallel=tp2sp"],
    ["parallel=tp2pp2"],
    ["parallel=tp2pp2", "parallel.dp=2", "parallel.zero=3"],
    ["parallel=pp2-interleaved"],
    ["parallel=pp2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"],
    ["recipe=moe-tiny", "parallel=ep2"],
    ["recipe=moe-tiny", "parallel=dp2ep2"],
    ["recipe=moe-tiny", "parallel=ep2", "parallel.zero=1"],
    ["recipe=moe-tiny", "parallel=dp2ep2", "parallel.zero=3"],
]


def _local(t):
    from llmforge.parallel.dtensor import local

    return local(t)


def _rank_bytes(plan: RunPlan, rank: int) -> tuple[int, int, int]:
    """(pipeline stage, parameter bytes, AdamW state bytes) of one rank, built by the backend."""
    from llmforge.parallel.mesh import build_mesh
    from llmforge.train.build import build_parts
    from llmforge.train.optim import build_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        mesh = build_mesh(plan.layout, device_type="cpu", timeout_s=plan.config.cluster.timeout_s)
        parts, _ = build_parts(plan, mesh=mesh, device=torch.device("cpu"))
        params = [p for part in parts for p in part.parameters()]
        optimizer = build_optimizer(torch.nn.ModuleList(parts), optim=plan.config.optim, lr=plan.config.train.lr)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        weights = sum(_local(p).numel() * _local(p).element_size() for p in params)
        states = sum(
            _local(v).numel() * _local(v).element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
        return mesh.local_rank("pp"), weights, states
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overrides", LAYOUTS, ids=[" ".join(o) for o in LAYOUTS])
def test_per_rank_parameter_and_optimizer_bytes_are_exact(overrides):
    plan = RunPlan.build(compose(overrides + ["train.micro_batch_size=2", "train.global_batch_size=16"]))
    shape, layout, job = from_plan(plan)
    real: dict = {}
    for rank in range(plan.world_size):
        stage, weights, states = _rank_bytes(plan, rank)
        old = real.get(stage, (0, 0))
        real[stage] = (max(old[0], weights), max(old[1], states))
    for stage, (weights, states) in real.items():
        params, _, _, optimizer = model_states(inventory(shape, layout), stage, job)
        sharded = layout.zero > 0 and layout.dp * layout.cp > 1
        # ZeRO 1-3 (FSDP2) keep the fp32 shard between steps; the moments are sharded alike
        assert weights == (optimizer // 2 if sharded else 4 * params)
        assert states == optimizer


def _saved_bytes_under_tp(plan: RunPlan) -> int:
    """Bytes rank 0 saves for backward in one forward of the tensor-parallel model (fake group)."""
    from llmforge.train.measure import selective_caches

    with selective_caches() as caches:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
        try:
            return _saved_bytes(plan, caches)
        finally:
            dist.destroy_process_group()


def _saved_bytes(plan: RunPlan, caches: list) -> int:
    from llmforge.parallel.mesh import build_mesh
    from llmforge.parallel.tensor import loss_context, sharded_cross_entropy
    from llmforge.train.build import build_parts
    from llmforge.train.measure import cached_tensors

    def key(t):
        return _local(t).untyped_storage()._cdata

    model = build_parts(
        plan, mesh=build_mesh(plan.layout, device_type="cpu", timeout_s=plan.config.cluster.timeout_s), device=torch.device("cpu")
    )[0][0]
    excluded = {key(p) for p in model.parameters()} | {key(b) for b in model.buffers()}
    saved: dict = {}

    def pack(t):
        if key(t) not in excluded:
            saved[key(t)] = max(saved.get(key(t), 0), _local(t).untyped_storage().nbytes())
        return t

    cfg = plan.config
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_len + 1))
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.precision.param_dtype == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), loss_context(plan.layout.tp):
        with cast:
            logits = model(tokens[:, :-1])
        sharded_cross_entropy(logits, tokens[:, 1:])
        for t in cached_tensors(caches):
            pack(t)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("layout", ["tp2", "tp2sp"])
def test_tensor_parallel_activations_match_the_backend(layout, recompute, dtype):
    from llmforge.estimate import activations as act

    plan = RunPlan.build(
        compose(
            [
                f"parallel={layout}",
                f"precision={dtype}",
                f"parallel.recompute={recompute}",
                "train.micro_batch_size=2",
                "train.global_batch_size=16",
            ]
        )
    )
    shape, lay, job = from_plan(plan)
    est = sum(act.layer_bytes(shape, lay, job, i) for i in range(shape.num_layers))
    est += act.embedding_bytes(shape, lay) + act.output_bytes(shape, lay, job)
    assert est == pytest.approx(_saved_bytes_under_tp(plan), rel=0.10)


# ------------------------------------------------- model states and saved bytes during the step

SMALL = ["model.num_layers=2", "model.vocab_size=512", "model.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8"]
ZERO_CASES = [(z, sp, r) for z in (0, 1, 2, 3) for sp in (False, True) for r in ("none", "selective", "full")]


@pytest.mark.parametrize("zero,sp,recompute", ZERO_CASES, ids=[f"zero{z}-{'dp2tp2sp' if sp else 'dp2'}-{r}" for z, sp, r in ZERO_CASES])
def test_model_states_and_saved_bytes_during_the_step_are_exact(zero, sp, recompute):
    """bf16 compute, two microbatches per step: what rank 0 holds after the first
    microbatch's backward (ZeRO 1/2 keep the gathered weights, ZeRO 1 whole fp32
    gradients) and what that microbatch saved, against the estimate."""
    from llmforge.estimate import activations as act

    layout = ["parallel=dp2tp2", "parallel.sequence_parallel=true"] if sp else ["parallel=dp2"]
    plan = RunPlan.build(compose(layout + SMALL + [f"parallel.zero={zero}", f"parallel.recompute={recompute}", "precision=bf16"]))
    from llmforge.train.footprint import measure_step

    (weights, grads, states), saved = measure_step(plan)
    shape, lay, job = from_plan(plan)
    _, est_weights, est_grads, est_states = model_states(inventory(shape, lay), 0, job)
    assert (weights, grads, states) == (est_weights, est_grads, est_states)
    est = sum(act.layer_bytes(shape, lay, job, i) for i in range(shape.num_layers))
    est += act.embedding_bytes(shape, lay) + act.output_bytes(shape, lay, job)
    assert saved == est
