"""Tensor parallelism's host cost on CPU ranks: the estimator counts the collectives and the
DTensor calls a real tp2 step makes (``llmforge.rehearse.counts``), and charges each at the
profile's calibrated cost (``llmforge.estimate.host``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from llmforge.calibrate import collectives
from llmforge.config.compose import compose
from llmforge.estimate import comm as cm
from llmforge.estimate import host
from llmforge.estimate.core import estimate
from llmforge.estimate.params import stage_counts
from llmforge.estimate.shape import from_plan
from llmforge.plan import RunPlan

TP2 = ["recipe=tiny", "parallel=tp2", "cluster.devices_per_node=2", "logging=quiet"]
VARIANTS = {"tiny": [], "two layers, no bias, two microbatches": ["model.num_layers=2", "model.bias=false", "train.global_batch_size=8"]}


def plan_of(extra):
    return RunPlan.build(compose(TP2 + list(extra)))


@pytest.fixture(scope="module")
def counted():
    from llmforge.rehearse.counts import count_step

    return {name: count_step(plan_of(extra)) for name, extra in VARIANTS.items()}


def _estimator_counts(plan):
    shape, layout, job = from_plan(plan)
    c = stage_counts(shape, layout)[0]
    m = plan.config.train.global_batch_size // layout.micro_batch_size
    collectives_ = host.tp_collectives(layout, layers=c.blocks, first=c.first, last=c.last, microbatches=m)
    calls = host.dtensor_ops(shape, layout, c, microbatches=m)
    return collectives_, calls


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_estimate_counts_the_collectives_a_tp2_step_issues(name, counted):
    ops = counted[name]
    expected, _ = _estimator_counts(plan_of(VARIANTS[name]))
    assert ops.collective_count("step") == expected  # blocks, embedding, output layer, vocab-parallel loss
    assert ops.collective_count("clip") == host.CLIP_COLLECTIVES
    assert ops.collective_count("optimizer") == 0


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_estimate_counts_the_dtensor_calls_a_tp2_step_makes(name, counted):
    _, expected = _estimator_counts(plan_of(VARIANTS[name]))
    assert sum(counted[name].dtensor.values()) == expected


def test_the_host_probe_makes_the_calls_a_tp2_step_makes(counted):
    """The calibration's per-call host time (``dtensor_op_us``) comes from a probe whose DTensor
    calls bring the Python work a real tp2 step's calls bring (a pair of bare linears' brought a
    fifth less): counted, so the machine's load does not matter."""
    from torch.distributed.device_mesh import DeviceMesh

    from llmforge.calibrate.host_probe import python_calls_per_dtensor_call
    from llmforge.rehearse.counts import count_step
    from llmforge.rehearse.fake import fake_process_group

    tp2, one = counted["tiny"], count_step(RunPlan.build(compose(["recipe=tiny", "logging=quiet"])))
    step = (sum(tp2.python_calls.values()) - sum(one.python_calls.values())) / sum(tp2.dtensor.values())
    with fake_process_group(rank=0, world_size=2):
        probe = python_calls_per_dtensor_call(DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    assert probe == pytest.approx(step, rel=0.1)


def _tp2_estimate(**keys):
    shape, layout, job = from_plan(plan_of([]))
    return estimate(shape, layout, dataclasses.replace(job, profile=dataclasses.replace(job.profile, **keys))), shape, layout


def test_each_dtensor_call_and_clip_collective_costs_the_calibrated_host_time():
    est, shape, layout = _tp2_estimate(dtensor_op_us=100.0, comm_latency_us=50.0)
    calls = host.dtensor_ops(shape, layout, stage_counts(shape, layout)[0], microbatches=4)
    clip = host.CLIP_COLLECTIVES * cm.all_reduce_hops(2) * 50e-6
    assert est.parts["tp_host"] == pytest.approx(calls * 100e-6 + clip)
    assert est.terms["tp_host"] == est.parts["tp_host"] and sum(est.terms.values()) == pytest.approx(est.step_s)
    none, _, _ = _tp2_estimate(dtensor_op_us=0.0, comm_latency_us=0.0)
    assert none.parts["tp_host"] == 0.0 and est.step_s - none.step_s >= calls * 100e-6


def test_every_tp_collective_pays_the_latency():
    est, shape, layout = _tp2_estimate(comm_latency_us=50.0)
    base, _, _ = _tp2_estimate(comm_latency_us=0.0)
    per_step = host.tp_collectives(layout, layers=4, first=True, last=True, microbatches=4)
    assert per_step == 4 * (4 * 4 + 1 + 1 + host.LOSS_COLLECTIVES)
    assert est.parts["tp_ep_comm"] - base.parts["tp_ep_comm"] == pytest.approx(per_step * cm.all_reduce_hops(2) * 50e-6)


def test_one_process_pays_no_tp_host_time():
    shape, layout, job = from_plan(RunPlan.build(compose(["recipe=tiny", "logging=quiet"])))
    est = estimate(shape, layout, dataclasses.replace(job, profile=dataclasses.replace(job.profile, dtensor_op_us=100.0)))
    assert est.parts["tp_host"] == 0.0


def test_a_cpu_sweep_times_small_messages_where_the_latency_shows():
    cpu, gpu = collectives.sizes(torch.device("cpu"), quick=True), collectives.sizes(torch.device("cuda"), quick=True)
    assert min(cpu) <= 4 * 2**10 and min(gpu) == 2**20  # GPUs: as before
