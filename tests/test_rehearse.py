"""``llmforge estimate --rehearse``: the most-loaded rank's build and steps on fake tensors over
torch's fake process group (tiny plans only: the full-scale rehearsals are in docs/estimator.md)."""

from __future__ import annotations

import dataclasses
import json
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.utils
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.commands.plans import build_plan
from llmforge.commands.rehearsal import should_rehearse, whole_compute_copy
from llmforge.errors import UserError
from llmforge.estimate.core import estimate_plan
from llmforge.rehearse.run import most_loaded_rank, rehearse
from llmforge.rehearse.tracker import PeakTracker

runner = CliRunner()
RESIZE, PROPAGATE = torch.UntypedStorage.resize_, ShardingPropagator._propagate_tensor_meta_non_cached
POST_BACKWARD = FSDPParamGroup.post_backward
SMALL = ["recipe=tiny", "model.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2"]
FSDP4 = [*SMALL, "parallel=fsdp", "cluster.devices_per_node=4"]
PP2 = [*SMALL, "parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.pp_schedule=1f1b", "cluster.devices_per_node=4"]
MOE_EP2 = [
    "recipe=moe-tiny",
    "model.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "parallel=dp2ep2",
    "cluster.devices_per_node=4",
]


@pytest.fixture(scope="module")
def fsdp4():
    plan = build_plan(FSDP4)
    est = estimate_plan(plan)
    return plan, est, rehearse(plan, stage=est.worst.stage)


def test_zero3_rank_keeps_the_shards_the_estimate_counts(fsdp4):
    """FSDP2 shards every parameter along dim 0 over the 4 ranks, and AdamW keeps two fp32
    moments of the shard: the rehearsed rank holds exactly the estimate's bytes of both."""
    _, est, r = fsdp4
    assert r.categories["weights"] == est.worst.weights
    assert r.categories["optimizer"] == pytest.approx(est.worst.optimizer, abs=1024)  # + AdamW's step counters
    assert r.categories["compute_copies"] > 0  # a gathered block at the peak
    assert sum(r.categories.values()) == r.step_peak_bytes


def test_rehearsed_peak_is_near_the_estimate(fsdp4):
    """The tensors the estimate counts (reserved bytes aside) against the rehearsed steady step:
    on this plan 0.94; a model that missed a whole item (the logits, the activations) would be
    off by far more than the bound."""
    _, est, r = fsdp4
    estimated = sum(getattr(est.worst, k) for k in ("weights", "grads", "optimizer", "activations", "transient"))
    assert 0.75 < r.step_peak_bytes / estimated < 1.25
    assert r.step_peak_bytes > r.first_step_peak_bytes  # AdamW's states appear in the first step


def test_sharded_build_holds_the_shards_and_one_whole_parameter():
    """The build makes the model on the meta device (no bytes) and fills this rank's shards from
    one whole value at a time: its peak is the shards plus the largest parameter (its whole value
    and this rank's slice of it), far below the whole model (here eight blocks of equal size).
    Counting the meta skeleton as held bytes would put the whole model at the peak."""
    from llmforge.train.build import model_skeleton

    plan = build_plan([*FSDP4, "model.num_layers=8", "model.vocab_size=1024"])
    est, r = estimate_plan(plan), rehearse(plan, stage=0)
    sizes = [p.numel() * 4 for p in model_skeleton(plan, stage=0).parameters()]  # whole fp32 values
    largest, whole_model = max(sizes), sum(sizes)
    assert r.build_peak_bytes <= est.worst.weights + largest + largest // 4 + 64 * 1024
    assert r.build_peak_bytes < whole_model / 2


def test_fake_tensors_rehearse_the_bytes_real_tensors_hold():
    """The same program on real tensors (tiny, over the same fake group) holds the same bytes at
    every peak, item by item: fake tensors change no allocation."""
    plan = build_plan([*SMALL, "parallel=dp2tp2"])
    fake, real = rehearse(plan, stage=0), rehearse(plan, stage=0, fake=False)
    assert (fake.build_peak_bytes, fake.first_step_peak_bytes, fake.step_peak_bytes) == (
        real.build_peak_bytes,
        real.first_step_peak_bytes,
        real.step_peak_bytes,
    )
    assert fake.categories == real.categories


def test_rehearsal_leaves_no_group_and_no_patch_behind(fsdp4):
    from llmforge.train import optim

    assert not dist.is_initialized()
    assert torch.utils.weakref is weakref
    assert optim.implementation.__module__ == "llmforge.train.optim"
    assert torch.UntypedStorage.resize_ is RESIZE
    assert ShardingPropagator._propagate_tensor_meta_non_cached is PROPAGATE
    assert FSDPParamGroup.post_backward is POST_BACKWARD


def test_zero1_whole_gradients_between_microbatches_are_rehearsed_as_gradients():
    """ZeRO 1 accumulates whole gradients in FSDP2's buffers over the microbatches that do not
    reduce (the estimate's gradients, 4 bytes a parameter); the rehearsal names them so, not as
    transient buffers (which left it at 0 gradients and 1.64x the estimate's transient)."""
    plan = build_plan([*SMALL, "precision=bf16", "parallel.dp=2", "parallel.zero=1", "cluster.devices_per_node=2"])
    est = estimate_plan(plan)
    items = rehearse(plan, stage=0).as_estimate_items(whole_compute_copy=whole_compute_copy(est))
    assert items["grads"] == est.worst.grads == 4 * est.worst.params
    assert items["transient"] < 1.1 * est.worst.transient


def test_tracker_tags_gradients_and_states_after_the_fact():
    model = torch.nn.Linear(64, 64, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    with PeakTracker(modules=[model], optimizer=opt) as t:
        model(torch.randn(8, 64)).sum().backward()
        t.tag_grads(model.parameters())
        opt.step()
        t.tag_optimizer(opt)
    cats = t.peak_by_category()
    assert cats["weights"] == 64 * 64 * 4
    assert cats["grads"] == 64 * 64 * 4  # tagged after backward, counted at the optimizer step's peak
    assert cats["optimizer"] >= 2 * 64 * 64 * 4


def test_estimate_rehearse_json_has_the_peak():
    result = runner.invoke(app, ["estimate", *FSDP4, "--rehearse", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)["rehearsal"]
    assert data["peak_bytes"] >= data["step_peak_bytes"] > 0
    assert set(data["memory_bytes"]) == {"weights", "grads", "optimizer", "activations", "transient"}
    assert sum(data["memory_bytes"].values()) == data["step_peak_bytes"]


def test_a_plan_the_rehearsal_cannot_run_is_refused_by_name():
    """fp16's loss scaling reads on the host whether the gradients are finite: fake tensors have no values."""
    result = runner.invoke(app, ["estimate", *SMALL, "precision.param_dtype=fp16", "--rehearse"])
    assert result.exit_code == 2
    assert "--rehearse" in result.output and "fp16" in result.output and "Traceback" not in result.output


def _estimated(est) -> float:
    return sum(getattr(est.worst, k) for k in ("weights", "grads", "optimizer", "activations", "transient"))


def test_pipeline_plan_rehearses_its_most_loaded_stage():
    """Pipeline stages are given their shapes (``llmforge.parallel.pipeline.StageShapes``), so one
    rank runs the real 1F1B schedule over the fake group without asking its neighbours. The
    estimate's most-loaded stage is rehearsed (here the last: the tiny model's output layer
    outweighs the first stage's extra microbatch in flight)."""
    plan = build_plan(PP2)
    est = estimate_plan(plan)
    result = runner.invoke(app, ["estimate", *PP2, "--rehearse", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)["rehearsal"]
    assert data["rank"] == most_loaded_rank(plan, stage=est.worst.stage)
    assert 0.75 < data["step_peak_bytes"] / _estimated(est) < 1.25


def test_moe_plan_rehearses_with_balanced_routing():
    """Expert parallel (ep2 over dp4): routing is balanced during the rehearsal, so every shape is
    known without the data. The tiny plan's peak comes in the first microbatch's backward, before
    any gradient shard exists (0.75 of the estimate's tensors, which count the gradients)."""
    plan = build_plan(MOE_EP2)
    est = estimate_plan(plan)
    r = rehearse(plan, stage=est.worst.stage)
    assert 0.6 < r.step_peak_bytes / _estimated(est) < 1.25
    assert any("balanced" in note for note in r.differences)


def _moe_layer(**moe):
    from llmforge.models.moe import MoE

    cfg = build_plan(["recipe=moe-tiny"]).config.model
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return layer, cfg.hidden_size


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_balanced_routing_shares_the_assignments_equally(capacity_factor):
    """Every expert gets tokens x top_k / experts assignments (at most the capacity), and the
    dispatch that knows them from the token count alone computes what the general one does."""
    from llmforge.models import balanced, moe

    layer, hidden = _moe_layer(capacity_factor=capacity_factor)
    tokens = torch.randn(32, hidden)
    capacity = moe.capacity_of(tokens=32, top_k=layer.top_k, num_experts=layer.num_experts, capacity_factor=capacity_factor)
    with balanced.balanced_routing():
        routing = moe.route(layer.router(tokens), top_k=layer.top_k, normalize=True, capacity=capacity)
        balanced = layer._dispatch_combine(tokens, routing)
    kept = moe.expert_counts(routing.experts[routing.keep], num_experts=layer.num_experts)
    assert kept.tolist() == [min(32 * layer.top_k // layer.num_experts, capacity or 64)] * layer.num_experts
    torch.testing.assert_close(balanced, layer._dispatch_combine(tokens, routing))


def test_train_rehearse_key():
    assert not should_rehearse(build_plan(["recipe=tiny"]))  # auto: small, on CPU
    assert should_rehearse(build_plan(["recipe=llama-70b"]))  # auto: 70B on H100s
    assert should_rehearse(build_plan(["recipe=tiny", "train.rehearse=always"]))
    assert not should_rehearse(build_plan(["recipe=llama-70b", "train.rehearse=never"]))
    with pytest.raises(UserError, match="train.rehearse"):
        build_plan(["recipe=tiny", "train.rehearse=yes"])


def test_pretrain_rehearses_before_launch_when_asked():
    result = runner.invoke(app, ["pretrain", *FSDP4, "train.rehearse=always", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "Rehearsed rank 0: peak" in result.output
    quiet = runner.invoke(app, ["pretrain", *FSDP4, "--dry-run"])  # auto: a tiny plan on CPU is not rehearsed
    assert quiet.exit_code == 0 and "Rehearsed" not in quiet.output


def test_tracker_leaves_out_dtensor_shape_propagation():
    """DTensor finds an op's output shape by running it on global-shape fake tensors, in the
    active fake mode: a rank holds none of them. An AdamW step over a parameter sharded 4 ways
    holds the shard, its gradient and two moments, nothing of the global size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from llmforge.rehearse.fake import fake_process_group, fake_tensors

    with fake_process_group(rank=0, world_size=4):
        mesh = init_device_mesh("cpu", (4,))
        with fake_tensors():
            param = torch.nn.Parameter(distribute_tensor(torch.randn(1024, 1024), mesh, [Shard(0)]))
            param.grad = distribute_tensor(torch.randn(1024, 1024), mesh, [Shard(0)])
            opt = torch.optim.AdamW([param], fused=True)
            with PeakTracker() as t:
                opt.step()
    shard = 1024 * 1024 * 4 // 4
    assert t.peak_bytes <= 2 * shard + 1024  # the two moments (and the step counter)


def test_estimate_counts_the_whole_embedding_gradient_a_first_stage_accumulates():
    """Under tp the embedding's gradient is a Partial of the whole table (DTensor has no
    row-sharded embedding backward), accumulated in fp32 across a pipeline's microbatches: what
    the 405B rehearsal showed alive at the peak (docs/estimator.md). Only the first stage has it."""
    overrides = [
        *SMALL,
        "parallel.dp=2",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.zero=3",
        "model.tie_embeddings=false",
        "cluster.devices_per_node=8",
    ]
    plan = build_plan(overrides)
    est = estimate_plan(plan)
    first, last = (next(s for s in est.stages if s.stage == i) for i in (0, 1))
    table = plan.config.model.vocab_size * plan.config.model.hidden_size
    assert first.grads == 4 * (first.params + table // 2)
    assert last.grads == 4 * last.params


def test_a_rehearsal_far_from_the_estimate_names_the_item():
    """More than 10% apart in total: the item furthest apart is named with both figures; within
    10% nothing is said."""
    from llmforge.commands.rehearsal import disagreement

    gib = 2**30
    estimated = {"weights": 10 * gib, "grads": 27 * gib, "optimizer": 10 * gib, "activations": 3 * gib, "transient": 3 * gib}
    assert disagreement(dict(estimated), estimated) == ""
    far = {**estimated, "grads": 0, "transient": 10 * gib}
    line = disagreement(far, estimated)
    assert "most in grads: 0.00 GiB rehearsed, 27.00 GiB estimated" in line and "rehearsed peak" in line


def test_a_pipelined_first_stage_under_tp_holds_two_whole_embedding_gradients():
    """Without FSDP, each microbatch's embedding gradient under tp is a Partial of the whole
    fp32 table, added out of place to the sum so far, while the pipeline keeps other
    microbatches' activations: the 175B first stage rehearsed 4.78 GiB of such transient
    buffers where the estimate had 0.03 (docs/estimator.md). Under FSDP2 the sum is taken in
    place in its own buffer; the last stage has no embedding."""
    from llmforge.estimate.inventory import inventory
    from llmforge.estimate.memory import _pipelined_embedding_bytes

    base = [*SMALL, "parallel.tp=2", "parallel.pp=2", "model.tie_embeddings=false"]
    table = 4096 * 128 * 4  # the tiny model's vocabulary x hidden, fp32
    cases = (
        (["cluster.devices_per_node=4"], 2 * table),
        (["parallel.dp=2", "parallel.zero=1", "cluster.devices_per_node=8"], 0),
        (["parallel.pp=1", "cluster.devices_per_node=2"], 0),
    )
    for extra, first in cases:
        est = estimate_plan(build_plan([*base, *extra]))
        inv = inventory(est.shape, est.layout)
        assert _pipelined_embedding_bytes(inv, 0) == first, extra
        assert _pipelined_embedding_bytes(inv, est.layout.pp - 1) == (0 if est.layout.pp > 1 else first)


def test_an_rmsnorm_plan_for_a_gpu_is_told_the_cpu_kernel_keeps_more():
    from llmforge.rehearse.run import RMSNORM_DIFFERENCE, differences

    llama = ["recipe=moe-tiny", "cluster.accelerator=h100-80gb"]
    assert RMSNORM_DIFFERENCE in differences(build_plan(llama))
    assert RMSNORM_DIFFERENCE not in differences(build_plan(["recipe=moe-tiny"]))  # a CPU rank runs that kernel
    assert RMSNORM_DIFFERENCE not in differences(build_plan(["recipe=tiny", "cluster.accelerator=h100-80gb"]))  # LayerNorm
