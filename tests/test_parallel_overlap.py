"""ZeRO 0's bucketed gradient reduction really overlaps with backward, in order,
and survives parameters without a gradient (llmforge.parallel.data)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from llmforge.parallel.data import BucketedGradReduce, grad_sync, plan_buckets
from llmforge.parallel.dtensor import local
from llmforge.parallel.tensor import apply_tp, loss_context, sharded_cross_entropy
from llmforge.testing.harness import tiny_plan
from llmforge.train.build import build_model

SMALL = 2048  # bytes: the tiny model's gradients then fill many buckets


def _backward(model: nn.Module, *, seed: int = 0) -> None:
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    with loss_context(2):  # the sharded loss is the plain one on undistributed logits
        sharded_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()


def _grads(model: nn.Module) -> dict:
    return {n: local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def test_buckets_follow_reverse_parameter_order_and_caps():
    assert plan_buckets([4, 4, 4, 4, 4], bucket_bytes=8, first_bucket_bytes=4) == [[4], [3, 2], [1, 0]]
    assert plan_buckets([100, 1], bucket_bytes=8, first_bucket_bytes=8) == [[1], [0]]


@pytest.mark.parametrize("tp", [False, True], ids=["plain", "dtensor"])
def test_buckets_launch_during_the_last_backward_before_every_gradient_is_ready(one_rank, tp):
    model = build_model(tiny_plan([]), device=torch.device("cpu"))
    if tp:  # DTensor parameters (tensor parallel on a one-rank mesh) fire the same hooks
        apply_tp(model, tp_mesh=init_device_mesh("cpu", (1,)), sequence_parallel=True)
    trace: list = []
    reducer = BucketedGradReduce(
        params=list(model.parameters()),
        group=one_rank.get_group(),
        size=1,
        dtype=torch.float32,
        bucket_bytes=SMALL,
        first_bucket_bytes=SMALL,
        trace=trace,
    )
    assert len(reducer.buckets) > 2
    with grad_sync([reducer], sync=False):
        _backward(model, seed=1)
    assert trace == [], "an earlier microbatch only accumulates"
    with grad_sync([reducer], sync=True):
        _backward(model, seed=2)
    during_backward = list(trace)
    expected = _grads(model)
    reducer()
    events = [kind for kind, _ in during_backward]
    last_ready = len(events) - 1 - events[::-1].index("ready")
    assert events.index("launch") < last_ready, "no bucket was launched before the last gradient was ready"
    assert [b for kind, b in during_backward if kind == "launch"] == list(range(len(reducer.buckets)))
    got = _grads(model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)


class _Partly(nn.Module):
    """Three parameters; ``skip`` is used only when asked to, ``never`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.arange(4.0))
        self.skip = nn.Parameter(torch.ones(4))
        self.never = nn.Parameter(torch.ones(4))
        self.last = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor, *, use_skip: bool) -> torch.Tensor:
        y = x * self.first + self.last * x
        return (y * self.skip if use_skip else y).sum()


def test_a_parameter_without_gradient_leaves_its_bucket_to_the_end(one_rank):
    module, trace = _Partly(), []
    reducer = BucketedGradReduce(
        params=list(module.parameters()),
        group=one_rank.get_group(),
        size=1,
        dtype=torch.float32,
        bucket_bytes=16,
        first_bucket_bytes=16,
        trace=trace,
    )
    with grad_sync([reducer], sync=True):
        module(torch.ones(4), use_skip=False).backward()
    # buckets in reverse order: [last], [never], [skip], [first]; only the first is complete in order
    assert [b for kind, b in trace if kind == "launch"] == [0]
    reducer()
    assert [b for kind, b in trace if kind == "launch"] == [0, 1, 2, 3]
    assert module.skip.grad is None and module.never.grad is None
    torch.testing.assert_close(module.first.grad, torch.ones(4))


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        module = _Partly()
        reducer = BucketedGradReduce(
            params=list(module.parameters()), group=dist.group.WORLD, size=2, dtype=torch.float32, bucket_bytes=16, first_bucket_bytes=16
        )
        with grad_sync([reducer], sync=True):
            module(torch.full((4,), float(rank + 1)), use_skip=rank == 0).backward()
        reducer()
        torch.save({n: p.grad for n, p in module.named_parameters()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_a_gradient_missing_on_one_rank_is_averaged_on_both(tmp_path: Path, free_port: int):
    out = str(tmp_path / "grads")
    mp.spawn(_worker, args=(free_port, out), nprocs=2, join=True)
    grads = [torch.load(f"{out}.{r}") for r in range(2)]
    # rank 0: x = 1, uses skip; rank 1: x = 2, does not
    y0 = torch.arange(4.0) + 2.0
    expected = {"first": (torch.ones(4) + 2 * torch.ones(4)) / 2, "last": (torch.ones(4) + 2 * torch.ones(4)) / 2, "skip": y0 / 2}
    for g in grads:
        assert g["never"] is None
        for name, value in expected.items():
            torch.testing.assert_close(g[name], value)


def test_the_estimate_leaves_exposed_the_bucket_the_last_gradient_launches(one_rank):
    """ZeRO 0: the bucket launched by the last gradient of the backward (nothing computes after
    it) is the last one, the one holding the embedding; every other bucket is launched while
    backward still computes. The estimate charges exactly that bucket when backward is long."""
    from llmforge.estimate import comm as cm
    from llmforge.estimate.shape import Job
    from llmforge.hardware import get_profile
    from llmforge.layout import Layout

    model, trace = build_model(tiny_plan([]), device=torch.device("cpu")), []
    reducer = BucketedGradReduce(
        params=list(model.parameters()),
        group=one_rank.get_group(),
        size=1,
        dtype=torch.float32,
        bucket_bytes=SMALL,
        first_bucket_bytes=SMALL,
        trace=trace,
    )
    with grad_sync([reducer], sync=True):
        _backward(model)
    reducer()
    last_ready = max(i for i, (kind, _) in enumerate(trace) if kind == "ready")
    assert [b for kind, b in trace[last_ready:] if kind == "launch"] == [len(reducer.buckets) - 1]
    names = [n for n, _ in model.named_parameters()]
    assert names.index("embed.weight") in reducer.buckets[-1]
    job = Job(
        global_batch=8,
        param_dtype="fp32",
        reduce_dtype="fp32",
        profile=get_profile("h100-80gb"),
        nodes=1,
        devices_per_node=2,
        bucket_bytes=2**20,
    )
    dense, embedding = 10 * 2**20, 3 * 2**20  # elements: the embedding's bucket is larger than bucket_bytes
    kinds = cm.dp_traffic(
        Layout(dp=2), job, dense=dense, expert=0, microbatches=4, blocks=4, t_fwd=1e9, t_bwd=2e9, span=2, last_bucket=embedding
    )
    traffic = kinds["dp_all_reduce"]
    assert traffic.exposed == pytest.approx(traffic.seconds * embedding / dense)
