"""A blocking collective after compute waits beyond its back-to-back time: the calibration times it
per second of that compute (the profile's ``comm_sync_share``, ``llmforge.calibrate.collectives.sync_samples``)
and the estimator charges it on a tensor-parallel rank's compute and host time (``llmforge.estimate.host``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from llmforge.calibrate import collectives, fit
from llmforge.calibrate.fit import CommSample
from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.estimate.core import estimate
from llmforge.estimate.shape import from_plan
from llmforge.hardware import parse_profile
from llmforge.plan import RunPlan

SWEEP = [CommSample("all_reduce", "intra", 2, n, 3e-4 + n / 1e9) for n in (4096, 65536, 2**20, 2**22)]
SYNC = [CommSample(fit.SYNC, "intra", 2, 2000, 6e-4), CommSample(fit.SYNC, "intra", 2, 8000, 2.4e-3)]


def _estimate(overrides: list[str], **keys):
    shape, layout, job = from_plan(RunPlan.build(compose(["recipe=tiny", "logging=quiet", *overrides])))
    return estimate(shape, layout, dataclasses.replace(job, profile=dataclasses.replace(job.profile, **keys)))


def test_a_tp_rank_pays_the_share_of_its_compute_and_host_time():
    est = _estimate(["parallel=tp2", "cluster.devices_per_node=2"], comm_sync_share=0.5, dtensor_op_us=10.0)
    assert est.parts["tp_sync"] == pytest.approx(0.5 * (est.parts["compute"] + est.parts["tp_host"]))
    assert est.terms["tp_sync"] == est.parts["tp_sync"] and sum(est.terms.values()) == pytest.approx(est.step_s)
    unmeasured = _estimate(["parallel=tp2", "cluster.devices_per_node=2"], comm_sync_share=0.0, dtensor_op_us=10.0)
    assert unmeasured.parts["tp_sync"] == 0.0
    assert est.step_s - unmeasured.step_s == pytest.approx(est.parts["tp_sync"])


@pytest.mark.parametrize("parallel", ["single", "dp2", "pp2"])
def test_without_tensor_parallelism_nothing_is_charged(parallel):
    extra = [] if parallel == "single" else ["cluster.devices_per_node=2"]
    assert _estimate([f"parallel={parallel}", *extra], comm_sync_share=0.5).parts["tp_sync"] == 0.0


def test_the_share_is_the_waits_over_the_compute_they_follow():
    assert fit.sync_share(SYNC) == pytest.approx((6e-4 + 2.4e-3) / 10e-3)
    assert fit.sync_keys(SWEEP + SYNC, {"name": "cpu"})["comm_sync_share"] == pytest.approx(0.3)
    assert fit.sync_share(SWEEP) is None and fit.sync_keys(SWEEP, {"name": "cpu"}) == {"name": "cpu"}


def test_the_latency_and_bandwidth_fit_leaves_the_sync_samples_out():
    assert fit.fit_comm(SWEEP + SYNC) == fit.fit_comm(SWEEP)


def test_a_profile_reads_the_share_and_refuses_a_negative_one():
    base = {"name": "x", "memory_gib": 1, "peak_tflops": {"fp32": 1, "bf16": 1, "fp16": 1}, "memory_bandwidth_gbs": 1}
    base |= {"intra_node_gbs": 1, "inter_node_gbs": 1, "devices_per_node": 2}
    assert parse_profile({**base, "comm_sync_share": 0.3}).comm_sync_share == 0.3
    assert parse_profile(base).comm_sync_share == 0.0
    with pytest.raises(UserError, match="comm_sync_share"):
        parse_profile({**base, "comm_sync_share": -0.1})


def test_the_probe_gives_one_sample_per_compute_span():
    from llmforge.rehearse.fake import fake_process_group

    with fake_process_group(rank=0, world_size=2):
        samples = collectives.sync_samples(link="intra", group=dist.group.WORLD, device=torch.device("cpu"), iters=1)
    assert [(s.op, s.nbytes) for s in samples] == [(fit.SYNC, round(span * 1e6)) for span in collectives.SYNC_SPANS]
    assert all(s.seconds >= 0 and s.ranks == 2 for s in samples)
