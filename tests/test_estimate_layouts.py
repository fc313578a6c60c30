"""Per-rank parameter and optimizer-state bytes: the estimate against the real backend.

Every rank of each layout is built in this one process on torch's fake process
group (collectives do nothing, shapes and sharding are real), with the backend's
own ``build_parts``; AdamW then takes one step on zero gradients so its states exist.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from llmforge.config.compose import compose  # noqa: E402
from llmforge.estimate.memory import model_states  # noqa: E402
from llmforge.estimate.shape import from_plan  # noqa: E402
from llmforge.plan import RunPlan  # noqa: E402

LAYOUTS = [
    ["parallel=dp2"],
    ["parallel=dp2", "parallel.zero=1"],
    ["parallel=dp2", "parallel.zero=2"],
    ["parallel=dp4", "parallel.zero=3"],
    ["parallel=tp2"],
    ["parallel=tp2sp"],
    ["parallel=tp2pp2"],
    ["parallel=tp2pp2", "parallel.dp=2", "parallel.zero=3"],
    ["parallel=pp2-interleaved"],
    ["parallel=pp2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2"],
    ["recipe=moe-tiny", "parallel=ep2"],
    ["recipe=moe-tiny", "parallel=dp2ep2"],
]


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _rank_bytes(plan: RunPlan, rank: int) -> tuple[int, int, int]:
    """(pipeline stage, parameter bytes, AdamW state bytes) of one rank, built by the backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmforge.parallel.mesh import build_mesh
    from llmforge.parallel.parallelize import build_parts
    from llmforge.train.optim import build_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        mesh = build_mesh(plan, device_type="cpu")
        parts, _ = build_parts(plan, mesh=mesh, device=torch.device("cpu"))
        params = [p for part in parts for p in part.parameters()]
        optimizer = build_optimizer(torch.nn.ModuleList(parts), optim=plan.config.optim, lr=plan.config.train.lr)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        weights = sum(_local(p).numel() * _local(p).element_size() for p in params)
        states = sum(
            _local(v).numel() * _local(v).element_size()
            for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0
        )
        return mesh.local_rank("pp"), weights, states
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overrides", LAYOUTS, ids=[" ".join(o) for o in LAYOUTS])
def test_per_rank_parameter_and_optimizer_bytes_are_exact(overrides):
    plan = RunPlan.build(compose(overrides + ["train.micro_batch_size=2", "train.global_batch_size=16"]))
    shape, layout, _ = from_plan(plan)
    real: dict = {}
    for rank in range(plan.world_size):
        stage, weights, states = _rank_bytes(plan, rank)
        old = real.get(stage, (0, 0))
        real[stage] = (max(old[0], weights), max(old[1], states))
    for stage, (weights, states) in real.items():
        params, _, _, optimizer = model_states(shape, layout, stage)
        sharded = layout.zero > 0 and layout.dp * layout.cp > 1
        # ZeRO 1-3 (FSDP2) keep the fp32 shard between steps; the moments are sharded alike
        assert weights == (optimizer // 2 if sharded else 4 * params)
        assert states == optimizer
