"""Shared fixtures: run every test away from the user's home and W&B account."""

from __future__ import annotations

import os
import tempfile

import pytest
from ports import pick_free_port


def pytest_configure(config: pytest.Config) -> None:
    """A test whose gloo rank is ended by a signal gets one more try, reported as a rerun (a
    failed assertion never does): ranks end through ``end_rank`` so that gloo's threads cannot
    abort them at exit, and what is left is the machine's doing (a loaded 2-core runner, the
    OOM killer). Set here rather than in addopts so that a machine without
    pytest-rerunfailures (the GPU one) still runs the suite."""
    if config.pluginmanager.hasplugin("rerunfailures") and not config.getoption("reruns", None):
        config.option.reruns = 1
        config.option.only_rerun = ["terminated with signal"]


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("LLMFORGE_CONFIG_PATH", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One prepared built-in corpus (small) shared by the tests that train."""
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="session")
def small_data(data_cache) -> list[str]:
    """Overrides that point a run at a small built-in corpus in a shared test cache."""
    return [f"data.cache_dir={data_cache}", "data.builtin_max_mb=0.5"]


os.environ.setdefault("OMP_NUM_THREADS", "1")
# Measured profiles (llmforge calibrate) go to a folder of this test session, never the
# user's; the first CPU run's automatic calibration is off unless a test turns it on.
os.environ["LLMFORGE_HOME"] = tempfile.mkdtemp(prefix="llmforge-home-")
os.environ.setdefault("LLMFORGE_AUTO_CALIBRATE", "0")
# Every rank the tests start checks that its collectives get tensors on its compute
# device (llmforge.launch.guard): the mistake NCCL refuses and gloo hides.
os.environ.setdefault("LLMFORGE_CHECK_COLLECTIVES", "1")


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process, as a one-dimensional CPU mesh (reductions are the identity)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    return pick_free_port()


@pytest.fixture
def cpu_profile_claiming(tmp_path):
    """A folder for LLMFORGE_CONFIG_PATH whose `cpu` profile claims ``inter_node_gbs`` GB/s
    between nodes (the pre-flight network check compares loopback gloo against it)."""
    import yaml

    from llmforge.hardware import BUILTIN_DIR

    def make(inter_node_gbs: float):
        data = yaml.safe_load((BUILTIN_DIR / "cpu.yaml").read_text())
        data["inter_node_gbs"] = inter_node_gbs
        folder = tmp_path / f"conf-{inter_node_gbs:g}"
        (folder / "profiles").mkdir(parents=True)
        (folder / "profiles" / "cpu.yaml").write_text(yaml.safe_dump(data))
        return folder

    return make
