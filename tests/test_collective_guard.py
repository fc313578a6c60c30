"""The collective guard (llmforge.launch.guard) that every rank the tests start runs
under: it must refuse a tensor off the rank's compute device, which on a CPU-only
machine is shown by declaring another compute device ("meta") for a one-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llmforge.launch.guard import CollectiveDeviceError, CollectiveGuard
from llmforge.train.stop import StopSignal


@pytest.fixture
def guard_on():
    """Install a guard for a given compute device; always uninstalled afterwards."""
    guards = []

    def install(device: str) -> CollectiveGuard:
        guards.append(CollectiveGuard(device=torch.device(device)).install())
        return guards[-1]

    yield install
    for guard in guards:
        guard.uninstall()


def test_a_cpu_tensor_on_a_rank_computing_elsewhere_is_refused(one_rank, guard_on):
    original = dist.all_reduce
    guard = guard_on("meta")  # stands for a GPU: anything but the CPU
    with pytest.raises(CollectiveDeviceError, match=r"all_reduce was handed a tensor on cpu at .*test_collective_guard\.py:\d+"):
        dist.all_reduce(torch.ones(1))
    # the stop flag as it was once built (a CPU tensor whatever the rank's device) is caught
    signal = StopSignal(device=torch.device("cpu"))
    with pytest.raises(CollectiveDeviceError, match=r"stop\.py:\d+ \(requested\)"):
        signal.requested()
    # through torch's other namespace and in lists of tensors too
    with pytest.raises(CollectiveDeviceError):
        dist.distributed_c10d.all_gather([torch.zeros(1)], torch.ones(1))
    # object collectives pickle through CPU tensors by design: allowed
    gathered = [None]
    dist.all_gather_object(gathered, {"a": 1})
    assert gathered == [{"a": 1}]
    assert guard.seen["all_reduce:cpu"] == 2
    guard.uninstall()
    assert dist.all_reduce is original


def test_tensors_on_the_rank_device_pass_and_are_counted(one_rank, guard_on):
    guard = guard_on("cpu")
    assert StopSignal(device=torch.device("cpu")).requested() is False
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert guard.seen["all_reduce:cpu"] == 2
    # pipeline schedules build P2POps from dist.isend: torch checks the op by identity
    assert dist.P2POp(dist.isend, torch.ones(1), 0).op is dist.distributed_c10d.isend
