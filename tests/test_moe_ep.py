"""Expert parallelism computes what one process computes (CPU, gloo, fp32).

Each test starts one process per rank. Every rank trains the same tiny MoE
model for a few steps twice: once alone over the whole global batch (ep=1,
gradient accumulation over every microbatch) and once with its experts sharded
by ``apply_ep`` over its share of the microbatches, gradients reduced as the
backend does (non-expert weights over all data-parallel ranks, expert weights
over expert replicas only). Losses and final weights must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmforge.config.schema import ModelConfig, MoEConfig
from llmforge.models.gpt import GPT
from llmforge.models.moe import moe_metrics, set_aux_loss_scale
from llmforge.train.step import cross_entropy

MICROBATCHES, MICRO_ROWS, SEQ, STEPS = 4, 2, 16, 3


def tiny_config(*, activation: str, capacity_factor: float | None) -> ModelConfig:
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        ffn_hidden_size=48,
        num_shared_experts=1,
        capacity_factor=capacity_factor,
        aux_loss_coef=0.05,
        z_loss_coef=0.01,
    )
    return ModelConfig(
        num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=96, seq_len=SEQ, activation=activation, moe=moe
    )


def batches(*, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    one_step = torch.randint(0, 96, (MICROBATCHES, MICRO_ROWS, SEQ + 1), generator=gen)
    return one_step.expand(STEPS, *one_step.shape)  # the same batch each step, so the loss falls


def train(model: GPT, data: torch.Tensor, *, reduce) -> list[float]:
    """A few SGD steps over this rank's microbatches; returns the step losses seen locally."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    set_aux_loss_scale([model], scale=lambda: 1.0 / data.shape[1])
    losses = []
    for step_data in data:
        total = 0.0
        for mb in step_data:
            loss = cross_entropy(model(mb[:, :-1]), mb[:, 1:])
            (loss / len(step_data)).backward()
            total += loss.item() / len(step_data)
        reduce(model)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _worker(rank: int, world: int, port: int, cfg_kwargs: dict, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        _compare(rank, world, cfg_kwargs, out)
    finally:
        dist.destroy_process_group()


def _compare(rank: int, world: int, cfg_kwargs: dict, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from llmforge.parallel.expert import apply_ep, expert_parameters, reduce_expert_grads
    from llmforge.parallel.recompute import apply_recompute

    torch.manual_seed(0)
    config, data = tiny_config(activation=cfg_kwargs["activation"], capacity_factor=cfg_kwargs["capacity_factor"]), batches(seed=7)
    reference = GPT(config)
    reference.init_weights(seed=11)
    ref_losses = train(reference, data, reduce=lambda m: None)

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replica", "ep"))
    model = GPT(config)
    model.init_weights(seed=11)
    apply_ep(model, ep_mesh=mesh["ep"])
    apply_recompute(model, mode=cfg_kwargs.pop("recompute"), every=1)  # EP inside checkpointed blocks
    replica = mesh["replica"].get_group() if world > 2 else None
    experts = {id(p) for p in expert_parameters(model)}

    def reduce(m: GPT) -> None:
        for p in m.parameters():
            if id(p) not in experts and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        reduce_expert_grads(m, replica_group=replica, dp_size=world)

    share = MICROBATCHES // world
    local = train(model, data[:, rank * share : (rank + 1) * share], reduce=reduce)
    losses = torch.tensor(local) / world
    dist.all_reduce(losses)
    metrics = _check_global_metrics(model, world=world)
    worst = max(float((_full(p) - r).detach().abs().max()) for p, r in zip(model.parameters(), reference.parameters(), strict=False))
    torch.testing.assert_close(losses.tolist(), ref_losses, rtol=1e-5, atol=1e-6)
    assert worst < 1e-5, f"weights differ from ep=1 by {worst}"
    if rank == 0:
        Path(out).write_text(json.dumps({"ep1": ref_losses, "ep": losses.tolist(), "max_weight_diff": worst, "metrics": metrics}))


def _check_global_metrics(model: GPT, *, world: int) -> dict:
    """The logged MoE statistics average every rank's layers (ranks route different tokens)."""
    from llmforge.models.moe import moe_layers
    from llmforge.parallel.expert import global_moe_metrics

    local = [layer.stats.summary()["dropped_frac"] for _, layer in moe_layers([model])]
    everyone = [None] * world
    dist.all_gather_object(everyone, local)
    expected = sum(sum(v) for v in everyone) / sum(len(v) for v in everyone)
    metrics = global_moe_metrics([model])
    assert metrics["moe/dropped_frac"] == pytest.approx(expected)
    assert moe_metrics([model]) == {}, "reading the statistics resets them"
    return metrics


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,cfg_kwargs",
    [
        (2, {"activation": "swiglu", "capacity_factor": None, "recompute": "selective"}),  # ep2: dp2 with both ranks in one ep group
        (4, {"activation": "gelu", "capacity_factor": 1.0, "recompute": "full"}),  # dp2 x ep2: two replicas of each expert shard
    ],
    ids=["ep2-dropless-swiglu-selective", "dp2xep2-capacity-gelu-full"],
)
def test_expert_parallel_matches_single_process(tmp_path, free_port: int, world: int, cfg_kwargs: dict) -> None:
    out = tmp_path / "result.json"
    mp.spawn(_worker, args=(world, free_port, cfg_kwargs, str(out)), nprocs=world, join=True)
    result = json.loads(out.read_text())
    assert result["ep1"][-1] < result["ep1"][0], "the reference run did not learn"
    if cfg_kwargs["capacity_factor"] is not None:
        assert result["metrics"]["moe/dropped_frac"] > 0, "capacity 1.0 dropped nothing; the test lost its point"
    print(json.dumps(result))
