"""The launch floor of the kernel model: a GPU's host runs ahead of its kernels, so the floor only
bounds a short kernel from below; a CPU's one thread issues each op and then runs it, so the
floor adds to every kernel."""

from __future__ import annotations

import dataclasses

import pytest

from llmforge.estimate.kernels import Speeds, speeds
from llmforge.estimate.shape import Job
from llmforge.hardware import get_profile

GPU_LIKE = Speeds(peak=1e12, matmul_efficiency=1.0, matmul_dim=0.0, attention_efficiency=1.0, bandwidth=1e9, floor=1e-5)


def test_the_floor_bounds_a_gpu_kernel_and_adds_to_a_cpu_one():
    cpu_like = dataclasses.replace(GPU_LIKE, serial=True)
    assert GPU_LIKE.memory(1e6, kernels=1).floor == 0  # 1 ms of work hides the 10 us floor
    assert GPU_LIKE.memory(1e3, kernels=1).floor == pytest.approx(1e-5 - 1e-6)  # a 1 us kernel is lifted to 10 us
    assert cpu_like.memory(1e6, kernels=1).floor == pytest.approx(1e-5)
    assert cpu_like.gemm(1000, 1000, 1000, count=3).floor == pytest.approx(3e-5)
    assert cpu_like.attention(1e9, kernels=2, head_dim=64).floor == pytest.approx(2e-5)


def test_only_cpu_ranks_add_the_floor():
    def job(accelerator: str) -> Job:
        return Job(global_batch=8, param_dtype="fp32", reduce_dtype="fp32", profile=get_profile(accelerator))

    assert speeds(job("cpu")).serial
    assert not speeds(job("h100-80gb")).serial
