"""A machine of known speeds for the calibration tests: the timing functions of
``llmforge.calibrate.compute`` are replaced by the times the fake machine's rates give, so
that a test knows which figures the profile must hold (and nothing depends on the load of
the machine the tests run on). Everything after the timings (passes, medians, the fits,
the profile's keys, the YAML, the lock, the write) runs as it does for real."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmforge.calibrate import apart, compute
from llmforge.calibrate.fit import AttentionSample, BandwidthSample, ComputeSamples
from llmforge.calibrate.probe import LoadReading

GIB = 2**30


@dataclass
class FakeMachine:
    """Rates in FLOP/s and bytes/s; ``slow`` multiplies every time (a loaded machine)."""

    rates: dict[str, float] = field(default_factory=lambda: {"fp32": 2.5e11, "bf16": 1.25e11, "fp16": 5e10})
    matmul_dim: float = 16.0
    attention: float = 1e11  # attention FLOP/s
    memory_bandwidth: float = 3e10  # memory-bound kernels
    copy_bandwidth: float = 1.2e10  # copies, read + write
    floor_s: float = 4e-6
    step_floor_s: float = 12e-6  # per kernel of a training step: the profile's kernel_floor_us
    dtensor_call_s: float = 60e-6  # host seconds a DTensor call adds (CPU)
    fsdp_s: dict[str, float] = field(default_factory=lambda: {"fsdp_unit": 300e-6, "fsdp_collective": 200e-6, "fsdp_param": 100e-6})
    memory_bytes: int = 24 * GIB
    slow: float = 1.0
    calls: list[str] = field(default_factory=list)

    def time_matmul(self, m, k, n, *, dtype, device, budget_s) -> float:
        self.calls.append(f"matmul {dtype}")
        return self.slow * 2 * m * k * n / self.rates[dtype] * (1 + self.matmul_dim * (1 / m + 1 / k + 1 / n))

    def time_attention(self, grid, *, dtype, device, tick) -> list:
        out = []
        for seq, head_dim in grid.attention:
            batch_heads = max(1, grid.attention_tokens // seq) * 8
            probe = AttentionSample(batch_heads, seq, head_dim, 0.0, 0.0)
            total = self.slow * 1.75 * probe.flops * (1 + self.matmul_dim / head_dim) / self.attention
            out.append(AttentionSample(batch_heads, seq, head_dim, total / 3.5, total))
            tick("attention")
        return out

    def time_bandwidth(self, grid, *, device, tick) -> list:
        out = []
        for n in grid.elements:
            out.append(BandwidthSample("copy", 8 * n, self.slow * 8 * n / self.copy_bandwidth))
            out.append(BandwidthSample("gelu", 20 * n, self.slow * 20 * n / self.memory_bandwidth))
            tick("memory-bound")
        return out

    def expected_memory_bandwidth(self, grid) -> float:
        """What the fit makes of ``time_bandwidth``: all bytes over all time."""
        samples = self.time_bandwidth(grid, device=None, tick=lambda what: None)
        return sum(s.nbytes for s in samples) / sum(s.seconds for s in samples)

    def host_costs(self) -> dict[str, float]:
        return {"dtensor_op": self.dtensor_call_s, **self.fsdp_s}

    def install(self, monkeypatch) -> FakeMachine:
        monkeypatch.setattr(compute, "time_matmul", self.time_matmul)
        monkeypatch.setattr(compute, "attention", self.time_attention)
        monkeypatch.setattr(compute, "bandwidth", self.time_bandwidth)
        monkeypatch.setattr(compute, "launch_floor", lambda *, device, budget_s: self.slow * self.floor_s)
        monkeypatch.setattr(compute, "step_floor", lambda *, device, budget_s: self.slow * self.step_floor_s)
        monkeypatch.setattr(compute, "host_memory_bytes", lambda: self.memory_bytes)
        monkeypatch.setattr(compute, "host_costs", self.host_costs)
        monkeypatch.setattr(compute, "CpuLoad", QuietLoad)
        monkeypatch.setattr(apart, "measure_apart", _measure_here)  # the fake patches this process, not a child
        return self


def _measure_here(*, quick: bool, threads: int, **_) -> ComputeSamples:
    import torch

    return compute.measure(torch.device("cpu"), quick=quick, threads=threads, tick=lambda what: None)


class QuietLoad:
    """A CPU load probe that reads an idle machine (``others_cores`` other processes' CPUs)."""

    others_cores = 0.0

    def __init__(self, *, threads: int):
        self.threads = threads

    def start(self) -> None:
        pass

    def stop(self) -> LoadReading:
        return LoadReading(wall_s=1.0, others_cpu_s=self.others_cores, cpus=2, threads=self.threads)
