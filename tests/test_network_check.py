"""The pre-flight network check (cluster.network_check): two launchers on loopback time an
all-reduce across their "nodes" before training, and the run is refused when the hardware
profile claims a far faster link than the one measured (loopback gloo); with a modest claim
the two-node run of tests/test_launch_multinode.py trains with the check on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmforge.launch.netcheck import network_problem, wanted
from llmforge.testing.harness import tiny_plan


def two_nodes(*extra: str):
    return tiny_plan(["parallel.dp=2", "cluster.nodes=2", "cluster.devices_per_node=1", *extra])


def test_the_check_is_on_across_nodes_on_accelerators_and_where_asked():
    assert wanted(two_nodes("cluster.accelerator=h100-80gb"))
    assert not wanted(two_nodes())  # a CPU profile describes no network
    assert wanted(two_nodes("cluster.network_check=true"))
    assert not wanted(two_nodes("cluster.accelerator=h100-80gb", "cluster.network_check=false"))
    assert not wanted(
        tiny_plan(["parallel.dp=2", "cluster.accelerator=h100-80gb", "cluster.devices_per_node=2", "cluster.network_check=true"])
    )


def test_a_slow_link_is_refused_naming_the_likely_causes(monkeypatch):
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    plan = two_nodes("cluster.accelerator=h100-80gb")  # 50 GB/s x comm_efficiency 0.7 between nodes
    assert network_problem(plan, measured=20e9) is None
    problem = network_problem(plan, measured=3e9)  # NCCL on TCP sockets
    assert problem is not None and problem.key == "cluster.network_check"
    for cause in ("sockets", "NCCL_SOCKET_IFNAME", "EFA", "NCCL_IB_DISABLE=1 is set here"):
        assert cause in problem.rule
    assert network_problem(two_nodes("cluster.accelerator=h100-80gb", "cluster.network_min_fraction=0.05"), measured=3e9) is None


@pytest.mark.parametrize(("rate", "refused"), [(20e9, False), (15e9, True)])
def test_the_measured_all_reduce_is_judged_as_timed(monkeypatch, rate, refused):
    """Each all-reduce of N bytes takes N / rate seconds on the slowest of 2 ranks (one per node): the
    bus bandwidth is the rate (nccl-tests' factor 2(n-1)/n = 1), judged against h100-80gb's 35 GB/s x 0.5."""
    import io

    import torch
    from rich.console import Console

    from llmforge.calibrate import collectives
    from llmforge.errors import UserError
    from llmforge.launch.netcheck import check_network

    monkeypatch.setattr(collectives.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(collectives, "_collective", lambda op, nbytes, *, group, device: nbytes)
    monkeypatch.setattr(collectives, "time_op", lambda nbytes, *, group, device, iters: nbytes / rate)
    out = io.StringIO()
    plan = two_nodes("cluster.accelerator=h100-80gb")
    if refused:
        with pytest.raises(UserError, match=f"reached {rate / 1e9:g} GB/s"):
            check_network(plan, device=torch.device("cpu"), console=Console(file=out))
    else:
        check_network(plan, device=torch.device("cpu"), console=Console(file=out))
        assert f"at {rate / 1e9:g} GB/s bus bandwidth" in out.getvalue()


def _two_launchers(tmp_path: Path, small_data, port: int, *, config_path: Path) -> list:
    args = [
        *small_data,
        "train.steps=2",
        "train.log_interval=1",
        "logging=quiet",
        "train.global_batch_size=8",
        "parallel=dp2",
        "cluster.nodes=2",
        "cluster.devices_per_node=1",
        "cluster.network_check=true",
        f"cluster.rdzv_endpoint=127.0.0.1:{port}",
        f"run.dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "LLMFORGE_CONFIG_PATH": str(config_path)}
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "llmforge", "pretrain", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for _ in range(2)
    ]
    return [(p.communicate(timeout=300)[0], p.returncode) for p in launchers]


@pytest.mark.slow
def test_two_nodes_on_loopback_are_refused_when_the_profile_claims_a_far_faster_link(tmp_path, small_data, free_port, cpu_profile_claiming):
    results = _two_launchers(tmp_path, small_data, free_port, config_path=cpu_profile_claiming(1e6))  # a petabyte per second
    assert [code for _, code in results] == [2, 2], results
    output = results[0][0]
    assert "all-reduce across the 2 nodes reached" in output and "NCCL_SOCKET_IFNAME" in output and "Traceback" not in output
    assert not (tmp_path / "run" / "checkpoints").exists()
