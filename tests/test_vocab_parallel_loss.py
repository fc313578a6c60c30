"""The estimator's cost of the vocabulary-parallel loss held to what ``loss_parallel`` runs.

Under tensor parallelism the loss runs on vocab-sharded DTensor logits
(``llmforge.parallel.tensor.sharded_cross_entropy``), and torch runs its log-softmax and
backward op by op. The test profiles one forward and backward on one rank of a fake
two-rank group and lists the kernels that read or write the whole shard: the innermost
launching aten ops with a ``[tokens, vocab / tp]`` input. They must be the estimator's
``VOCAB_PARALLEL_LOSS_OPS`` (plus the two casts of 16-bit logits)."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from test_kernel_count import _launches  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from llmforge.estimate import kernels as kn  # noqa: E402
from llmforge.parallel.tensor import loss_context, sharded_cross_entropy  # noqa: E402

TOKENS, SHARD = 32, 64


@pytest.fixture
def fake_tp2():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield DeviceMesh.from_group(dist.group.WORLD, "cpu")
    finally:
        dist.destroy_process_group()


def _shard_kernels(mesh, dtype: torch.dtype) -> Counter[str]:
    local = torch.randn(2, TOKENS // 2, SHARD, dtype=dtype)
    targets = torch.randint(0, 2 * SHARD, (2, TOKENS // 2))

    def step() -> None:
        logits = DTensor.from_local(local, mesh, [Shard(-1)]).detach().requires_grad_()
        with loss_context(2):
            sharded_cross_entropy(logits, targets).backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()

    def on_shard(e) -> bool:
        return any(list(s) == [TOKENS, SHARD] for s in e.input_shapes if isinstance(s, list))

    inner = [e for e in prof.events() if _launches(e) and on_shard(e) and not any(_launches(c) and on_shard(c) for c in e.cpu_children)]
    return Counter(e.name.removeprefix("aten::") for e in inner)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_estimator_lists_the_kernels_loss_parallel_runs_on_a_shard(fake_tp2, dtype):
    expected = Counter({op: calls for op, calls, _ in kn.VOCAB_PARALLEL_LOSS_OPS})
    if dtype != torch.float32:
        expected["copy_"] += 2  # the logits' .float(), the gradient's cast back
    assert _shard_kernels(fake_tp2, dtype) == expected


def test_a_tensor_parallel_stage_charges_the_vocab_parallel_loss():
    sp = kn.Speeds(peak=1e12, matmul_efficiency=1.0, matmul_dim=0.0, attention_efficiency=1.0, bandwidth=1e9, floor=0.0)
    kinds = ("chunked", "vocab_parallel")
    per_logit = {kind: kn.loss_cost(sp, tokens=1000, vocab=1000, c=4, kind=kind).memory * 1e3 for kind in kinds}
    assert per_logit == {"chunked": pytest.approx(40), "vocab_parallel": pytest.approx(72)}
    assert kn.loss_cost(sp, tokens=1000, vocab=1000, c=2, kind="vocab_parallel").memory * 1e3 == pytest.approx(72 + 12)
