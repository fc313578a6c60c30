"""FSDP2's host work on CPU ranks: the calibration's probe (``llmforge.calibrate.host_probe``), its
fit into three costs (``llmforge.calibrate.fit.fit_fsdp_host``) and what the estimator charges
(``llmforge.estimate.host.fsdp_host_seconds``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llmforge.calibrate import host_probe
from llmforge.calibrate.fit import FSDP_COSTS, FsdpSample, fit_fsdp_host
from llmforge.config.compose import compose
from llmforge.estimate import comm
from llmforge.estimate.core import estimate
from llmforge.estimate.shape import from_plan
from llmforge.models.gpt import GPT
from llmforge.plan import RunPlan
from llmforge.rehearse.fake import fake_process_group

COSTS = {"fsdp_unit": 300e-6, "fsdp_collective": 200e-6, "fsdp_param": 100e-6}


def _probes(costs: dict[str, float]) -> list[FsdpSample]:
    """The probe's design, each sample taking what ``costs`` say it should."""
    out = []
    for blocks, microbatches in host_probe.FSDP_SHAPES:
        for zero in host_probe.FSDP_STAGES:
            sample = FsdpSample(blocks=blocks, microbatches=microbatches, zero=zero, params=12 * blocks + 4, seconds=0.0)
            seconds = sum(costs[name] * n for name, n in zip(FSDP_COSTS, sample.counts(), strict=True))
            out.append(dataclasses.replace(sample, seconds=seconds))
    return out


def test_the_fit_recovers_the_three_costs_from_the_probes_design():
    assert fit_fsdp_host(_probes(COSTS)) == pytest.approx(COSTS)


def test_a_cost_the_probes_do_not_show_is_zero_not_negative():
    fitted = fit_fsdp_host(_probes({**COSTS, "fsdp_param": -50e-6}))
    assert fitted["fsdp_param"] == 0.0 and all(v >= 0 for v in fitted.values())


def test_the_probe_steps_add_host_time_under_every_zero_stage(monkeypatch):
    """On torch's fake process group (collectives return at once) a sharded step of a model a few
    elements wide takes longer than the unsharded one: FSDP2's hooks, copies and DTensor optimizer."""
    monkeypatch.setattr(host_probe, "FSDP_SHAPES", ((2, 1), (2, 2)))
    monkeypatch.setattr(host_probe, "FSDP_CALLS", 2)
    monkeypatch.setattr(host_probe, "FSDP_ROUNDS", 1)
    torch.set_num_threads(1)
    with fake_process_group(rank=0, world_size=2):
        samples = host_probe.fsdp_samples(DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    assert len(samples) == 4 and all(s.seconds > 0 for s in samples), samples
    model = GPT(host_probe._fsdp_model_config(blocks=2))
    assert {s.params for s in samples} == {len(list(model.parameters()))}


def _plan(parallel: str) -> RunPlan:
    return RunPlan.build(compose(["recipe=tiny", "logging=quiet", f"parallel={parallel}", "cluster.devices_per_node=2"]))


def _estimate(plan: RunPlan, **keys):
    shape, layout, job = from_plan(plan)
    return estimate(shape, layout, dataclasses.replace(job, profile=dataclasses.replace(job.profile, **keys))), layout


@pytest.mark.parametrize("parallel", ["zero1", "fsdp"])
def test_a_zero_rank_pays_its_hooks_collectives_and_parameters(parallel):
    plan = _plan(parallel)
    est, layout = _estimate(plan, fsdp_unit_us=300.0, fsdp_collective_us=200.0, fsdp_param_us=100.0)
    m, blocks = est.microbatches, plan.config.model.num_layers
    gathers, scatters = comm.fsdp_collectives(zero=layout.zero, pp=1, blocks=blocks, microbatches=m)
    params = len(list(GPT(plan.config.model).parameters()))
    expected = 300e-6 * (blocks + 1) * m + 200e-6 * (gathers + scatters) + 100e-6 * params
    assert est.parts["fsdp_host"] == pytest.approx(expected)
    assert est.terms["fsdp_host"] == est.parts["fsdp_host"] and sum(est.terms.values()) == pytest.approx(est.step_s)


@pytest.mark.parametrize("parallel", ["dp2", "tp2", "pp2"])
def test_without_zero_sharding_nothing_is_charged(parallel):
    est, _ = _estimate(_plan(parallel), fsdp_unit_us=300.0, fsdp_collective_us=200.0, fsdp_param_us=100.0)
    assert est.parts["fsdp_host"] == 0.0
