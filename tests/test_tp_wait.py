"""A tensor-parallel step's blocking collectives wait beyond their back-to-back time: the calibration
times real tensor-parallel steps (``llmforge.calibrate.tp_step``) and fits the wait per collective
(``llmforge.calibrate.tp_wait``); the estimator charges it, and on a tensor-parallel rank a
hand-set share of the compute before them (``llmforge.estimate.host``).
``tests/test_collective_waits.py`` holds the count of every layout's blocking collectives."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from llmforge.calibrate import fit, tp_step, tp_wait
from llmforge.calibrate.fit import TP_STEP, CommSample
from llmforge.calibrate.tp_wait import PROBES, Expected
from llmforge.calibrate.write import as_mapping
from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.estimate.core import estimate
from llmforge.estimate.host import step_collectives, tp_collectives
from llmforge.estimate.shape import from_plan
from llmforge.hardware import get_profile, parse_profile
from llmforge.layout import Layout
from llmforge.plan import RunPlan

SWEEP = [CommSample("all_reduce", "intra", 2, n, 3e-4 + n / 1e9) for n in (4096, 65536, 2**20, 2**22)]
TP2 = ["parallel=tp2", "cluster.devices_per_node=2"]


def _estimate(overrides: list[str], **keys):
    shape, layout, job = from_plan(RunPlan.build(compose(["recipe=tiny", "logging=quiet", *overrides])))
    return estimate(shape, layout, dataclasses.replace(job, profile=dataclasses.replace(job.profile, **keys)))


def test_a_tp_rank_pays_a_wait_per_collective_and_a_share_of_its_compute_and_host_time():
    est = _estimate(TP2, comm_sync_us=500.0, comm_sync_share=0.5, dtensor_op_us=10.0)
    collectives = tp_collectives(Layout(tp=2), layers=4, first=True, last=True, microbatches=4, per_step=True)
    assert collectives == 4 * (4 * 4 + 1 + 4) + 1  # four a block, the embedding, the output layer and loss; the clip
    waited = collectives + step_collectives(Layout(tp=2))
    assert waited == collectives + 1  # the stop vote
    assert est.parts["collective_waits"] == pytest.approx(500e-6 * waited + 0.5 * (est.parts["compute"] + est.parts["tp_host"]))
    assert est.terms["collective_waits"] == est.parts["collective_waits"] and sum(est.terms.values()) == pytest.approx(est.step_s)
    unmeasured = _estimate(TP2, comm_sync_us=0.0, comm_sync_share=0.0, dtensor_op_us=10.0)
    assert unmeasured.parts["collective_waits"] == 0.0
    assert est.step_s - unmeasured.step_s == pytest.approx(est.parts["collective_waits"])


def _cpu_profile_data() -> dict:
    return {**as_mapping(get_profile("cpu")), "comm_sync_us": 0.0, "comm_sync_share": 0.0}


def test_the_fit_recovers_the_wait_the_probe_steps_took():
    """Steps that took what the estimator counts plus 600 us a collective give back that figure,
    through the estimator's own view of each probe, and clear a share an older profile held."""
    data = {**_cpu_profile_data(), "comm_sync_share": 0.4}
    profile = parse_profile(data)
    samples = []
    for index, probe in enumerate(PROBES):
        e = tp_wait.expected(probe, profile, tp=2)
        samples.append(CommSample(TP_STEP, "intra", 2, index, e.seconds + 600e-6 * e.collectives))
    keys = tp_wait.wait_keys(SWEEP + samples, data, profile=profile)
    assert keys["comm_sync_us"] == pytest.approx(600, rel=1e-3) and "comm_sync_share" not in keys
    assert tp_wait.wait_keys(SWEEP, data, profile=profile) == data  # no probe steps: unchanged


def test_the_probes_span_the_compute_between_collectives():
    """The probes differ several times over in compute per collective, on either side of the tiny
    recipe's, so the wait is fitted across what a run's collectives follow."""
    profile = parse_profile(_cpu_profile_data())
    small, large = (tp_wait.expected(p, profile, tp=2) for p in PROBES)
    assert large.between_s / large.collectives > 2 * small.between_s / small.collectives


def test_the_fit_is_the_least_squares_wait_and_never_negative():
    few, many = Expected(1.0, 10, 0.5), Expected(1.0, 100, 0.1)
    # 2 ms and 3 ms a collective: least squares over the collectives weighs the row with more of them
    wait = tp_wait.fit_wait([(few, 1.0 + 0.02), (many, 1.0 + 0.3)])
    assert wait == pytest.approx((10 * 0.02 + 100 * 0.3) / (10**2 + 100**2))
    assert tp_wait.fit_wait([(few, 0.9), (many, 0.8)]) == 0.0  # faster than counted: no wait


def test_the_latency_and_bandwidth_fit_leaves_the_probe_steps_out():
    steps = [CommSample(TP_STEP, "intra", 2, 0, 0.1), CommSample(TP_STEP, "intra", 2, 1, 0.3)]
    assert fit.fit_comm(SWEEP + steps) == fit.fit_comm(SWEEP)


def test_a_profile_reads_the_waits_and_refuses_negative_ones():
    base = {"name": "x", "memory_gib": 1, "peak_tflops": {"fp32": 1, "bf16": 1, "fp16": 1}, "memory_bandwidth_gbs": 1}
    base |= {"intra_node_gbs": 1, "inter_node_gbs": 1, "devices_per_node": 2}
    read = parse_profile({**base, "comm_sync_us": 450.0, "comm_sync_share": 0.3})
    assert (read.comm_sync_us, read.comm_sync_share) == (450.0, 0.3)
    assert (parse_profile(base).comm_sync_us, parse_profile(base).comm_sync_share) == (0.0, 0.0)
    for key in ("comm_sync_us", "comm_sync_share"):
        with pytest.raises(UserError, match=key):
            parse_profile({**base, key: -0.1})


@pytest.mark.parametrize(
    ("schedule_ms", "most", "calls"),
    [
        ([50, 40, 30, 20, 10, 10, 10, 10, 10, 10, 10], 30, 9),  # settled once the three before are as fast
        ([10] * 8, 30, 6),  # steady from the start: the least
        ([60, 50, 40, 32, 26, 21, 17, 14, 11, 9], 8, 8),  # still falling: stopped at the most
    ],
)
def test_the_warm_up_runs_until_the_steps_settle(schedule_ms, most, calls):
    import time

    from llmforge.rehearse.fake import fake_process_group

    times = iter(schedule_ms)
    with fake_process_group(rank=0, world_size=2):
        assert tp_step.warm_up(lambda: time.sleep(next(times) / 1e3), group=dist.group.WORLD, most=most) == calls


def test_the_probes_run_a_sharded_training_step(monkeypatch):
    from llmforge.rehearse.fake import fake_process_group

    monkeypatch.setattr(tp_step, "WARMUP_MOST", 1)
    with fake_process_group(rank=0, world_size=2):
        samples = tp_step.tp_step_samples(link="intra", group=dist.group.WORLD, quick=True)
    assert [(s.op, s.link, s.ranks, s.nbytes) for s in samples] == [(TP_STEP, "intra", 2, i) for i in range(len(PROBES))]
    assert all(s.seconds > 0 for s in samples)
    assert tp_step.can_shard(ranks=2) and tp_step.can_shard(ranks=4)
    assert not tp_step.can_shard(ranks=1) and not tp_step.can_shard(ranks=3)


@pytest.mark.parametrize("index", range(len(PROBES)))
def test_a_probe_step_issues_what_a_training_rank_of_the_same_model_issues(index):
    """The probe's step makes the DTensor calls and collectives of rank 0 of ``llmforge pretrain``
    on the same model and batch (``llmforge.rehearse.counts``), and the estimator counts those
    collectives: what the fit divides among them is what a training step waits on."""
    from llmforge.rehearse.counts import count_step, counted
    from llmforge.rehearse.fake import fake_process_group

    probe = PROBES[index]
    config = compose(["recipe=tiny", "logging=quiet", *TP2])
    batch = {"micro_batch_size": probe.micro_batch, "global_batch_size": probe.micro_batch * probe.microbatches}
    plan = RunPlan.build(dataclasses.replace(config, model=probe.model, train=dataclasses.replace(config.train, **batch)))
    real = count_step(plan)
    with fake_process_group(rank=0, world_size=2):
        step = tp_step.stepper(probe.model, micro_batch=probe.micro_batch, microbatches=probe.microbatches, group=dist.group.WORLD)
        step()
        dtensor, collectives = counted(step)
    assert dtensor == sum(real.dtensor.values())
    assert sum(collectives.values()) == sum(real.collective_count(phase) for phase in real.dtensor)
    assert sum(collectives.values()) == tp_wait.expected(probe, parse_profile(_cpu_profile_data()), tp=2).collectives


def test_a_probe_step_starts_from_a_runs_weights_and_sees_new_tokens_each_microbatch(monkeypatch):
    """torch's default initialisation (embeddings of standard deviation 1) makes a 256-wide
    model's softmax put denormal or zero probability on part of a 4096 vocabulary, and the output
    layer's backward matmuls over those run many times slower than a run's first steps."""
    from llmforge.config.schema import ModelConfig
    from llmforge.models.gpt import GPT

    seen: list[tuple] = []

    class Watched(GPT):
        def forward(self, tokens, *args, **kwargs):
            logits = super().forward(tokens, *args, **kwargs)
            seen.append((tokens.clone(), logits.detach().softmax(-1).min().item()))
            return logits

    monkeypatch.setattr(tp_step, "GPT", Watched)
    model = ModelConfig(num_layers=1, hidden_size=256, num_heads=4, ffn_hidden_size=512, vocab_size=4096, seq_len=32)
    step = tp_step.stepper(model, micro_batch=2, microbatches=2, group=None)
    step()
    step()
    assert len(seen) == 4
    assert min(p for _, p in seen) > 1.2e-38  # the smallest normal fp32
    assert all(not torch.equal(seen[0][0], tokens) for tokens, _ in seen[1:])
