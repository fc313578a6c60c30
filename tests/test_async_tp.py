"""parallel.async_tp: refused where it cannot run (one message naming the key, exit 2),
no change to the compiled blocks or Inductor's config when off, the same numbers from
torch's tensor-parallel styles it switches the column-parallel linears to, and the
estimate's tensor-parallel time hidden as far as the matmuls last. (Async TP itself
runs only on CUDA with two or more GPUs: unmeasured here.)"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmforge.blockspec.block import describe
from llmforge.cli import app
from llmforge.config.choices import Activation
from llmforge.estimate.core import estimate
from llmforge.layout import Layout

GPU = ["recipe=gpt-1b", "cluster.accelerator=h100-80gb", "cluster.devices_per_node=8", "parallel.dp=auto"]
ON = ["parallel.tp=8", "parallel.sequence_parallel=true", "train.compile=true", "parallel.async_tp=true"]


def _plan(*overrides: str):
    return CliRunner().invoke(app, ["plan", *overrides])


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (
            ["recipe=tiny", "parallel.tp=2", "parallel.sequence_parallel=true", "train.compile=true", "parallel.async_tp=true"],
            "cluster.accelerator=cpu",
        ),
        (GPU + [o for o in ON if o != "train.compile=true"], "train.compile=false"),
        (GPU + [o for o in ON if o != "parallel.sequence_parallel=true"], "parallel.sequence_parallel=false"),
        (GPU + ["train.compile=true", "parallel.async_tp=true"], "parallel.tp=1"),
    ],
    ids=["cpu", "no-compile", "no-sp", "tp1"],
)
def test_async_tp_is_refused_where_it_cannot_run(overrides, reason):
    result = _plan(*overrides)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if "parallel.async_tp" in line]
    assert len(lines) == 1 and reason in lines[0] and "Fix:" in lines[0], result.output


def test_async_tp_plans_on_gpus_with_compile_and_sequence_parallel():
    assert _plan(*GPU, *ON).exit_code == 0


def test_off_leaves_inductor_and_the_blocks_as_they_were():
    import torch._inductor.config as inductor

    from llmforge.testing.harness import tiny_plan
    from llmforge.train.build import build_model
    from llmforge.train.parallelize import parallelize

    plan = tiny_plan(["train.compile=true"])
    assert plan.config.parallel.async_tp is False
    model = build_model(plan, device=torch.device("cpu"))
    before = [type(m) for m in model.modules()]
    parallelize(model, plan=plan, mesh=None)
    assert inductor._micro_pipeline_tp is False
    assert not _symm_mem_groups()
    assert [type(m) for m in model.modules()] == before  # compiled in place: the same modules


def _symm_mem_groups() -> dict:
    from torch.distributed import _symmetric_memory

    return dict(getattr(_symmetric_memory, "_group_name_to_store", {}))


def _loss_and_grads(model) -> tuple:
    from llmforge.parallel.dtensor import local
    from llmforge.parallel.tensor import loss_context, sharded_cross_entropy

    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.seq_len + 1), generator=torch.Generator().manual_seed(3))
    with loss_context(2):
        loss = sharded_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    return float(loss.detach()), {n: local(p.grad).clone() for n, p in model.named_parameters()}


def test_the_async_tp_styles_compute_what_the_sequence_parallel_op_does(one_rank):
    """On a one-rank mesh: torch's column-parallel styles (async TP) and llmforge's
    shard-keeping op give the same loss and gradients as the plain model."""
    from llmforge.parallel.sequence import PrecomputedLinear
    from llmforge.parallel.tensor import apply_tp
    from llmforge.testing.harness import tiny_plan
    from llmforge.train.build import build_model

    plan = tiny_plan([])
    results = {}
    for name, kwargs in (("plain", None), ("sp_op", {"async_tp": False}), ("async_tp", {"async_tp": True})):
        model = build_model(plan, device=torch.device("cpu"))
        if kwargs is not None:
            apply_tp(model, tp_mesh=one_rank, sequence_parallel=True, **kwargs)
            kept = any(isinstance(m, PrecomputedLinear) for m in model.modules())
            assert kept == (not kwargs["async_tp"]), "async TP must leave the column linears to torch's styles"
        results[name] = _loss_and_grads(model)
    for name in ("sp_op", "async_tp"):
        assert results[name][0] == pytest.approx(results["plain"][0], rel=1e-6)
        for key, grad in results["plain"][1].items():
            torch.testing.assert_close(results[name][1][key], grad, rtol=1e-5, atol=1e-6)


def _megatron(async_tp: bool):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_search import gpt, job

    shape = gpt(heads=48, hidden=6144, layers=40, vocab=131072, seq=4096)
    jb = dataclasses.replace(job("h100-80gb", batch=512, world=256), compile=True)
    return estimate(
        shape, Layout(dp=32, tp=8, zero=1, sequence_parallel=True, micro_batch_size=1, async_tp=async_tp), jb, every_stage=False
    )


def test_the_estimate_hides_what_async_tp_overlaps():
    off, on = _megatron(False), _megatron(True)
    tp_off, tp_on = off.comm.kinds["tp"], on.comm.kinds["tp"]
    assert tp_off.exposed == tp_off.seconds  # without async TP every TP collective is on the critical path
    assert tp_on.bytes < tp_off.bytes  # no backward re-gather: torch's styles keep the gathered input
    assert 0 < tp_on.exposed < 0.5 * tp_on.seconds  # mostly hidden, as far as the decomposed matmuls last
    # the decomposition costs compute: chunked matmuls, the reduce-scatters' sums
    assert on.terms["matmul"] > off.terms["matmul"] and on.terms["memory_bound"] > off.terms["memory_bound"]
    # its copies run on the copy engines: only the data-parallel hiding is charged the SMs NCCL holds
    sm = on.job.profile.comm_sm_share
    assert on.terms["comm_overlap"] == pytest.approx(sm * sum(t.hidden for k, t in on.comm.kinds.items() if k != "tp"))
    assert on.worst.activations > off.worst.activations  # the gathered inputs are saved
    assert on.step_s < off.step_s


def _pair(gather: bool, *, tp: int = 8, m: float = 4096, collective: float = 1.0):
    from llmforge.estimate import async_tp as atp
    from llmforge.estimate import kernels as kn

    sp = kn.speeds(_megatron(True).job)
    return sp, atp.pair_cost(sp, gather=gather, m=m, k=6144, n=2304, tp=tp, collective=collective, c=2, scale=1.0)


def test_a_fused_pair_hides_at_most_what_its_other_chunks_compute():
    """torch's fused ops overlap each chunk's transfer with another chunk's matmul: the first
    gathered (or last scattered) chunk has none, and tp chunks of tokens / tp rows run slower
    than one matmul of all of them."""
    sp, long_comm = _pair(True, collective=1.0)
    chunked = sp.gemm(4096 / 8, 6144, 2304, count=8).seconds
    assert long_comm.hidden == pytest.approx(7 / 8 * chunked)
    _, short_comm = _pair(True, collective=1e-6)
    assert short_comm.hidden == 1e-6
    assert long_comm.cost.matmul > 0  # the chunks are slower than the whole matmul
    assert (
        _pair(True, m=65536)[1].cost.matmul / sp.gemm(65536, 6144, 2304).seconds < long_comm.cost.matmul / sp.gemm(4096, 6144, 2304).seconds
    )


def test_a_fused_reduce_scatter_sums_its_partials_in_a_kernel_of_its_own():
    sp, scatter = _pair(False)
    _, gather = _pair(True)
    summed = sp.memory(4096 * 2304 * 2 * (1 + 1 / 8), kernels=1).memory
    assert scatter.cost.memory == pytest.approx(summed)  # every partial read, the shard written
    assert gather.cost.memory < scatter.cost.memory  # the gather only copies its own shard in


def test_the_fused_pairs_are_the_ones_the_backend_gives_the_pass():
    """Inductor fuses a reduce-scatter only when one matmul feeds it, and a gather only when
    matmuls consume it: llmforge's q/k/v and gate/up are one linear each, so every pair fuses in
    bf16; under float8 the gathered tensors are cast before their matmul, so only the
    reduce-scatters do, and the estimate hides less."""
    from llmforge.estimate import async_tp as atp

    shape = _megatron(True).shape
    for activation, mlp_in in ((Activation.GELU, "mlp.up_proj"), (Activation.SWIGLU, "mlp.gate_up_proj")):
        block = describe(dataclasses.replace(shape, activation=activation), moe=False)
        assert [x.name for x in block.linears if x.split == "col"] == ["attn.qkv_proj", mlp_in]  # one linear per sublayer
    bf16 = _megatron(True).job
    fp8 = dataclasses.replace(bf16, fp8=True)
    assert atp.backend_pairs(bf16) == frozenset(atp.PAIRS)
    assert atp.backend_pairs(fp8) == {"forward_scatter", "backward_scatter"}
    est = _megatron(True)
    kwargs = {"attention_layers": 40, "mlp_layers": 40}
    every = atp.async_tp(est.shape, est.layout, fp8, pairs=frozenset(atp.PAIRS), **kwargs)
    assert 0 < atp.async_tp(est.shape, est.layout, fp8, **kwargs).hidden < every.hidden
