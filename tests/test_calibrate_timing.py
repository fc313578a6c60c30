"""How the calibration times a kernel (``llmforge.calibrate.timing``) and what its probes run
(``llmforge.calibrate.compute``): warm-up calls never timed, enough timed calls, CUDA events on
a GPU, probes that run only the kernels they count, and a pass judged against the others at
one ``matmul_dim``. Time is a fake clock the calls advance: nothing depends on the machine."""

from __future__ import annotations

import pytest
import torch

from llmforge.calibrate import compute, timing, trust
from llmforge.calibrate.fit import AttentionSample, BandwidthSample, ComputeSamples, MatmulSample, fit_compute
from llmforge.models import layers

CPU = torch.device("cpu")


class FakeKernel:
    """A callable whose n-th call takes ``costs[n]`` seconds of a fake clock (the last cost after)."""

    def __init__(self, costs: list[float]):
        self.costs, self.calls, self.now = costs, 0, 0.0

    def __call__(self) -> None:
        self.now += self.costs[min(self.calls, len(self.costs) - 1)]
        self.calls += 1

    def install(self, monkeypatch) -> FakeKernel:
        monkeypatch.setattr(timing, "clock", lambda: self.now)
        return self


def test_a_slow_calls_warm_up_is_not_timed_and_it_is_timed_once_a_round(monkeypatch):
    # kernel selection and allocation make the first two calls slow; then single calls vary by 2x
    kernel = FakeKernel([2.0, 1.0, 0.9, 0.7, 0.8, 0.5, 0.7]).install(monkeypatch)
    assert timing.seconds_per_call(kernel, device=CPU, budget_s=0.05) == pytest.approx(0.7)  # the median of 0.9 .. 0.7
    assert kernel.calls == timing.WARMUP_CALLS + timing.ROUNDS


def test_a_fast_call_warms_up_for_a_quarter_of_the_budget_then_takes_the_median_round(monkeypatch):
    # a GPU whose clocks rise during its first milliseconds: 4 ms a call at first, 1 ms once warm
    kernel = FakeKernel([0.004] * 4 + [0.001]).install(monkeypatch)
    assert timing.seconds_per_call(kernel, device=CPU, budget_s=0.05) == pytest.approx(0.001)
    warm = timing.warm_up(FakeKernel([0.001]).install(monkeypatch), device=CPU, budget_s=0.4)
    assert warm == pytest.approx(0.001)
    assert timing.clock() >= 0.1  # a quarter of the budget spent warming up


class FakeEvent:
    """A CUDA event on the fake clock."""

    def __init__(self, *, enable_timing: bool):
        self.at = 0.0

    def record(self) -> None:
        self.at = timing.clock()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000  # milliseconds, as torch.cuda.Event says


def test_on_a_gpu_the_rounds_are_timed_by_cuda_events_around_the_back_to_back_calls(monkeypatch):
    kernel = FakeKernel([0.003, 0.002] + [0.0005]).install(monkeypatch)
    synced = []
    monkeypatch.setattr(timing, "synchronize", lambda device: synced.append(device.type))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    cuda = torch.device("cuda")
    assert timing.time_calls(kernel, calls=4, device=cuda) == pytest.approx(0.003 + 0.002 + 2 * 0.0005)
    assert synced == ["cuda"]  # the queue drained before the first event, not after each call
    assert timing.seconds_per_call(kernel, device=cuda, budget_s=0.05) == pytest.approx(0.0005)


def test_the_memory_bound_probes_return_gradients_instead_of_accumulating_them():
    x, grad = torch.randn(4096, requires_grad=True), torch.randn(4096)
    kernels = compute.training_kernels(x, grad, width=128)
    assert set(kernels) == {"gelu", "layer_norm", "log_softmax"}
    for run in kernels.values():
        first, second = run()[0], run()[0]
        assert torch.equal(first, second)
    assert x.grad is None  # no accumulation kernel, which training's activations never run
    model_gelu = torch.autograd.grad(layers.gelu(x), x, grad)[0]
    assert torch.equal(kernels["gelu"]()[0], model_gelu)  # the model's GELU (tanh), not the exact one
    assert not torch.allclose(model_gelu, torch.autograd.grad(torch.nn.functional.gelu(x), x, grad)[0])
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    forward, both = compute.attention_calls(q, k, v, torch.randn(1, 2, 16, 8))
    assert len(both()) == 3 and forward().shape == q.shape
    assert q.grad is None and k.grad is None and v.grad is None


def test_a_gpus_memory_bound_sizes_are_beyond_its_cache_and_its_norm_rows_a_models_width():
    gpu = torch.device("cuda")
    for quick in (True, False):
        assert min(compute.grid_for(gpu, quick=quick).elements) * 4 >= 256 * 2**20  # fp32, above any L2 (50-126 MB)
    assert compute.norm_width(gpu) >= 768 and compute.norm_width(CPU) == 128


def _pass(noise: tuple[float, ...], *, attention: float = 1e11, dim: float = 48.0) -> ComputeSamples:
    """A pass of a machine at 1e11 FLOP/s whose matmul timings carry ``noise`` (a factor each)."""
    shapes = [(t, h, 4 * h) for h in (128, 512) for t in (512, 2048)]
    samples = ComputeSamples(device="cpu", device_name="fake", threads=2, floor_s=1e-6)
    samples.matmul["fp32"] = [
        MatmulSample(m, k, n, 2 * m * k * n / 1e11 * (1 + dim * (1 / m + 1 / k + 1 / n)) * f)
        for (m, k, n), f in zip(shapes, noise, strict=True)
    ]
    probe = AttentionSample(128, 128, 32, 0.0, 0.0)
    total = 1.75 * probe.flops * (1 + dim / 32) / attention
    samples.attention["fp32"] = [AttentionSample(128, 128, 32, total / 3.5, total)]
    samples.bandwidth = [BandwidthSample("copy", 8 * 2**20, 8 * 2**20 / 1e10)]
    return samples


def test_passes_are_compared_at_one_matmul_dim_so_noise_in_the_fit_is_no_disagreement():
    passes = [_pass((1.05, 1, 1, 0.95)), _pass((1, 1, 1, 1)), _pass((0.95, 1, 1, 1.05))]
    alone = [fit_compute(p) for p in passes]
    assert len({f.matmul_dim for f in alone}) == 3  # fitted on its own, each pass picks another matmul_dim
    rates = [f.attention_flops for f in alone]
    assert max(rates) / min(rates) - 1 > trust.MAX_SPREAD  # and its attention rate, read there, moves by 50%
    verdict = trust.judge(trust.combine(passes))
    assert verdict.trusted and verdict.spread < 0.01


def test_a_pass_whose_attention_ran_slower_is_still_caught():
    passes = [_pass((1, 1, 1, 1)), _pass((1, 1, 1, 1), attention=5e10), _pass((1, 1, 1, 1))]
    verdict = trust.judge(trust.combine(passes))
    assert not verdict.trusted and "the attention rate varied by 100%" in verdict.reasons[0]
