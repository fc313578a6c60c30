"""Every collective a CPU rank's host blocks on waits the profile's ``comm_sync_us``
(``llmforge.estimate.host``): the estimator's count of them, layout by layout, is held to what a
real step of the rank issues (``llmforge.rehearse.counts``), and one process waits for none."""

from __future__ import annotations

import dataclasses

import pytest

from llmforge.config.compose import compose
from llmforge.estimate import host
from llmforge.estimate.core import estimate
from llmforge.estimate.shape import from_plan
from llmforge.plan import RunPlan

LAYOUTS = {
    "dp2": ["parallel=dp2", "cluster.devices_per_node=2"],
    "zero1": ["parallel=zero1", "cluster.devices_per_node=2"],
    "fsdp": ["parallel=fsdp", "cluster.devices_per_node=2"],
    "tp2": ["parallel=tp2", "cluster.devices_per_node=2"],
    "dp2, ZeRO 0 overlapped": ["parallel=dp2", "cluster.devices_per_node=2", "parallel.overlap_grad_reduce=true"],
}


def _plan(extra: list[str]) -> RunPlan:
    return RunPlan.build(compose(["recipe=tiny", "logging=quiet", *extra]))


def _waited(plan: RunPlan, *, sync_us: float = 1e6, share: float = 0.0) -> float:
    """The step's collective waits at ``sync_us`` each (by default one second: their count)."""
    shape, layout, job = from_plan(plan)
    profile = dataclasses.replace(job.profile, comm_sync_us=sync_us, comm_sync_share=share)
    return estimate(shape, layout, dataclasses.replace(job, profile=profile)).parts["collective_waits"]


@pytest.mark.parametrize("name", ["dp2", "zero1", "fsdp", "tp2"])
def test_the_estimate_waits_on_each_collective_a_cpu_rank_blocks_on(name):
    """The step's collectives (forward and backward, the gradient reduction, the loss's mean), the
    clip's and the training loop's stop vote, which the rehearsal does not run."""
    from llmforge.rehearse.counts import count_step

    plan = _plan(LAYOUTS[name])
    ops = count_step(plan)
    issued = ops.collective_count("step") + ops.collective_count("clip") + ops.collective_count("optimizer") + host.STOP_VOTES
    assert _waited(plan) == pytest.approx(issued)


def test_overlapped_buckets_are_waited_on_once_when_backward_ends():
    plan = _plan(LAYOUTS["dp2, ZeRO 0 overlapped"])
    assert _waited(plan) == pytest.approx(1 + host.CLIP_COLLECTIVES + host.STOP_VOTES + 1)  # buckets, clip, stop, loss


def test_one_process_waits_for_no_collective():
    assert _waited(_plan([])) == 0.0


@pytest.mark.parametrize("parallel", ["dp2", "pp2"])
def test_the_share_of_compute_is_a_tensor_parallel_ranks_alone(parallel):
    plan = _plan([f"parallel={parallel}", "cluster.devices_per_node=2"])
    assert _waited(plan, sync_us=500.0, share=0.5) == pytest.approx(_waited(plan, sync_us=500.0))


def test_a_pipeline_stage_waits_on_the_clip_the_stop_vote_and_the_loss_but_not_its_sends():
    """Its point-to-point transfers are the schedule's, which the bubble charges."""
    assert _waited(_plan(["parallel=pp2", "cluster.devices_per_node=2"])) == pytest.approx(3)
