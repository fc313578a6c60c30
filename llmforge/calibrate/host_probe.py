"""The host cost of tensor parallelism per DTensor call, measured in a process of its own:

    python -m llmforge.calibrate.host_probe     # prints the microseconds

A pair of small linears, the first column-parallel and the second row-parallel (as a block's
MLP is sharded, ``llmforge.parallel.tensor``), runs forward, backward and the for-loop AdamW
step of CPU ranks on a fake process group of two ranks (collectives return at once), and the
same pair unsharded. The tensors are tiny, so the difference of the two is host work: DTensor's
dispatch, the parallel styles' hooks, wrapping and unwrapping, redistributions. Divided by
the DTensor calls the sharded pass makes (``llmforge.rehearse.counts``), it is the profile's
``dtensor_op_us``, what ``llmforge.estimate.host`` charges per call. Times are this thread's
CPU time (waiting for a core on a shared machine is left out), the fastest of a few rounds.
Its own process: the fake group must be the default one, and a calibrating rank has its real one.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from llmforge.parallel.dtensor import DTensorCalls

WIDTH = 8
ROUNDS = 5


def _pair() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _seconds(model: nn.Module, x: torch.Tensor, *, calls: int) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    _step(model, optimizer, x)
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.thread_time()
        for _ in range(calls):
            _step(model, optimizer, x)
        best = min(best, (time.thread_time() - start) / calls)
    return best


def measure(*, calls: int = 20) -> float:
    """Host seconds per DTensor call (needs a process without a process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    x = torch.randn(4, WIDTH)
    plain = _seconds(_pair(), x, calls=calls)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        sharded = parallelize_module(_pair(), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        tp = _seconds(sharded, x, calls=calls)
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3, foreach=False)
        with DTensorCalls() as mode:
            _step(sharded, optimizer, x)
    finally:
        dist.destroy_process_group()
    return max(0.0, tp - plain) / max(1, mode.dtensor)


def in_subprocess(*, timeout_s: float = 120.0) -> float:
    """``measure`` in a fresh one-thread process; 0.0 where it cannot run."""
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "llmforge.calibrate.host_probe"], env=env, capture_output=True, text=True, timeout=timeout_s
        )
        return float(done.stdout.strip().splitlines()[-1]) * 1e-6 if done.returncode == 0 else 0.0
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0.0


if __name__ == "__main__":
    print(f"{measure() * 1e6:.3f}")
