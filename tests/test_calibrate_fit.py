"""The calibration's fits (no torch) and the profile keys it writes."""

from __future__ import annotations

import pytest

from llmforge.calibrate import fit
from llmforge.calibrate.fit import AttentionSample, CommSample, MatmulSample
from llmforge.errors import UserError
from llmforge.hardware import get_profile, machine_profile_path, parse_profile

DATASHEET = {
    "name": "card",
    "memory_gib": 80,
    "peak_tflops": {"fp32": 60, "bf16": 1000, "fp16": 1000},
    "memory_bandwidth_gbs": 3000,
    "intra_node_gbs": 400,
    "inter_node_gbs": 50,
    "devices_per_node": 8,
}


def _matmuls(rate: float, dim: float) -> list:
    shapes = [(t, h, 4 * h) for h in (256, 1024, 4096) for t in (512, 8192)] + [(h, t, 4 * h) for h in (256, 4096) for t in (512, 8192)]
    return [MatmulSample(m, k, n, 2 * m * k * n / rate * (1 + dim * (1 / m + 1 / k + 1 / n))) for m, k, n in shapes]


def test_the_matmul_fit_recovers_the_model_it_is_fitted_to():
    rate, dim = fit.fit_matmul(_matmuls(7e14, 48.0), floor_s=5e-6)
    assert dim == 48.0 and rate == pytest.approx(7e14, rel=1e-9)


def test_attention_efficiency_is_against_the_peak_with_the_head_stretch():
    peak, dim = 1e15, 32.0
    s = AttentionSample(batch_heads=64, seq=2048, head_dim=128, forward_s=0.0, total_s=0.0)
    seconds = 1.75 * s.flops * (1 + dim / 128) / (peak * 0.6)
    sample = AttentionSample(64, 2048, 128, seconds / 3.5, seconds)
    assert fit.fit_attention([sample], peak=peak, matmul_dim=dim) == pytest.approx(0.6)


def test_latency_per_hop_and_bandwidth_come_back_from_collective_timings():
    """Timings made as the estimator charges them (a latency per hop: an all-reduce over 8
    ranks passes 6 tree steps, an all-gather 7 ring steps) give back that hop's latency."""
    hop = 5e-6
    samples = [CommSample("all_reduce", "intra", 8, n, 6 * hop + n * 2 * 7 / 8 / 370e9) for n in (2**20, 2**24, 2**28, 2**30)]
    samples += [CommSample("all_gather", "intra", 8, n, 7 * hop + n * 7 / 8 / 370e9) for n in (2**20, 2**26)]
    samples += [CommSample("send_recv", "intra", 8, n, hop + n / 370e9) for n in (2**20, 2**26)]
    ((latency, bandwidth),) = fit.fit_comm(samples).values()
    assert latency == pytest.approx(hop, rel=1e-6) and bandwidth == pytest.approx(370e9, rel=1e-6)


def test_bus_bandwidth_factors_are_nccl_tests():
    assert fit.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert fit.bus_factor("all_gather", 8) == fit.bus_factor("reduce_scatter", 8) == fit.bus_factor("all_to_all", 8) == pytest.approx(0.875)
    assert fit.bus_factor("send_recv", 8) == 1.0


def test_a_gpu_keeps_its_datasheet_peaks_and_gets_measured_efficiencies():
    fitted = fit.Fitted(
        rates={"fp32": 5e13, "bf16": 8e14, "fp16": 8e14},
        matmul_dim=48,
        attention_flops=6e14,
        bandwidth=2.4e12,
        floor_s=6e-6,
        memory_bytes=80 * 2**30,
        reserved_bytes=2**29,
        device="cuda",
        reference_dtype="bf16",
    )
    keys = fit.compute_keys(fitted, DATASHEET)
    assert keys["peak_tflops"] == DATASHEET["peak_tflops"]
    assert keys["matmul_efficiency"] == 0.8 and keys["attention_efficiency"] == 0.6 and keys["bandwidth_efficiency"] == 0.8
    keys = fit.comm_keys({"intra": (2e-5, 370e9)}, keys)
    p = parse_profile({**keys, "calibration": {"device": "card"}})
    assert p.intra_node_bandwidth * p.comm_efficiency == pytest.approx(370e9, rel=1e-2)
    assert p.inter_node_bandwidth * p.comm_efficiency == pytest.approx(50e9 * 0.7, rel=1e-2)  # not measured: as before
    assert p.comm_latency_us == 20 and p.calibrated


def test_a_cpu_gets_its_measured_rates_as_peaks():
    fitted = fit.Fitted(
        rates={"fp32": 1.2e11, "bf16": 6e10, "fp16": 1e9},
        matmul_dim=8,
        attention_flops=3e10,
        bandwidth=2e10,
        floor_s=8e-6,
        memory_bytes=16 * 2**30,
        reserved_bytes=0,
        device="cpu",
        reference_dtype="fp32",
    )
    p = parse_profile(fit.compute_keys(fitted, {**DATASHEET, "name": "cpu"}))
    assert p.peak("fp32") == pytest.approx(1.2e11) and p.matmul_efficiency == 1.0
    assert p.memory_bandwidth == pytest.approx(2e10) and p.attention_efficiency == 0.25 and p.kernel_floor_us == 8


def test_a_profile_calibration_section_must_be_a_mapping():
    with pytest.raises(UserError, match="calibration"):
        parse_profile({**DATASHEET, "calibration": "yesterday"})
    assert not parse_profile(DATASHEET).calibrated


def test_cpu_means_this_machines_profile_for_the_threads_of_a_rank(tmp_path, monkeypatch):
    import yaml

    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    path = machine_profile_path(3)
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({**DATASHEET, "name": "cpu", "calibration": {"threads": 3}}))
    assert get_profile("cpu").calibrated
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not get_profile("cpu").calibrated


@pytest.mark.parametrize("name", ["cpu", "h100-80gb", "a100-80gb", "b200", "l4-24gb", "h200-141gb", "a100-40gb"])
def test_a_profile_written_back_is_the_profile_it_was_read_from(name):
    import dataclasses

    from llmforge.calibrate.write import as_mapping
    from llmforge.hardware import BUILTIN_DIR

    p = get_profile(str(BUILTIN_DIR / f"{name}.yaml"))
    again = parse_profile(as_mapping(p), source=p.source, description=p.description)
    assert dataclasses.asdict(again) == dataclasses.asdict(p)


def test_a_gpu_calibration_measures_the_host_link_and_memory_and_keeps_the_rest():
    from llmforge.calibrate.fit import BandwidthSample, ComputeSamples, fit_compute
    from llmforge.calibrate.write import as_mapping

    samples = ComputeSamples(
        device="cuda", device_name="card", threads=1, floor_s=5e-6, memory_bytes=80 * 2**30, host_memory_bytes=1000 * 2**30
    )
    samples.matmul["bf16"] = _matmuls(7e14, 48.0)
    samples.bandwidth = [BandwidthSample("copy", 2**30, 2**30 / 2.4e12)]
    samples.host_copies = [BandwidthSample("h2d", 2**28, 2**28 / 53e9), BandwidthSample("d2h", 2**28, 2**28 / 48e9)]
    datasheet = as_mapping(get_profile("h100-80gb"))
    p = parse_profile({**fit.compute_keys(fit_compute(samples), datasheet), "calibration": {"device": "card"}})
    assert p.host_memory_bytes == 1000 * 2**30  # measured: the datasheet says 2048
    assert p.host_link_bandwidth == pytest.approx(48e9, rel=5e-3)  # the slower direction
    assert p.host_memory_bandwidth == 600e9 and p.comm_sm_share == 0.24 and p.comm_latency_us == 5  # not measured: the datasheet's
    assert p.matmul_efficiency == pytest.approx(7e14 / 989.4e12, rel=5e-3)
