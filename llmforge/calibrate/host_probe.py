"""The host cost of tensor parallelism per DTensor call, measured in a process of its own:

    python -m llmforge.calibrate.host_probe     # prints the microseconds

A one-block GPT a few elements wide (embedding, attention, MLP, tied output layer and loss:
the layers a tensor-parallel step runs, ``llmforge.parallel.tensor`` sharding them as it
shards a run's model) runs forward, backward and the for-loop AdamW step of CPU ranks on a
fake process group of two ranks (collectives return at once), and the same model unsharded.
The tensors are tiny, so the difference of the two is host work: DTensor's dispatch and
sharding propagation, the parallel styles' hooks, wrapping and unwrapping, redistributions,
the vocabulary-parallel loss. Divided by the DTensor calls the sharded step makes (as
``llmforge.rehearse.counts`` counts them), it is the profile's ``dtensor_op_us``, what
``llmforge.estimate.host`` charges per call: a call costs what it costs in a real step's mix
of calls, not in a pair of bare linears (whose calls are cheaper: fewer Python calls and
nested operators each). Times are this thread's CPU time (waiting for a core on a shared
machine is left out), the fastest of a few rounds. Its own process: the fake group must be
the default one, and a calibrating rank has its real one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmforge.config.schema import ModelConfig
from llmforge.models.gpt import GPT
from llmforge.parallel.dtensor import DTensorCalls, PythonCalls
from llmforge.parallel.tensor import align_grads, apply_tp, loss_context, sharded_cross_entropy

ROUNDS = 5
#: One block, a few elements wide: the compute is negligible next to the host work.
TINY = {"num_layers": 1, "hidden_size": 8, "num_heads": 2, "ffn_hidden_size": 32, "vocab_size": 64, "seq_len": 4}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**TINY))


def _sharded(mesh) -> GPT:
    model = _model()
    apply_tp(model, tp_mesh=mesh, sequence_parallel=False)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, TINY["seq_len"] + 1), generator=torch.Generator().manual_seed(0))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, *, tp: int) -> None:
    with loss_context(tp):
        logits = model(tokens[:, :-1])
        targets = tokens[:, 1:]
        loss = sharded_cross_entropy(logits, targets) if tp > 1 else F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
    if tp > 1:
        align_grads(list(model.parameters()))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _stepper(model: nn.Module, *, tp: int) -> Callable[[], None]:
    """One training step of ``model`` per call (the first one already run)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = _tokens()
    step = lambda: _step(model, optimizer, tokens, tp=tp)  # noqa: E731
    step()
    return step


def _seconds(step: Callable[[], None], *, calls: int) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.thread_time()
        for _ in range(calls):
            step()
        best = min(best, (time.thread_time() - start) / calls)
    return best


def python_calls_per_dtensor_call(mesh) -> float:
    """Python-level calls each DTensor call of the sharded step brings along (the sharded step's
    minus the unsharded one's, over its DTensor calls), on ``mesh`` (two ranks): what the host
    time per call is made of, counted (the tests hold it to a real tp2 step's)."""
    counts = []
    for step in (_stepper(_model(), tp=1), _stepper(_sharded(mesh), tp=2)):
        with DTensorCalls() as mode:
            step()
        with PythonCalls() as python:
            step()
        counts.append((python.calls, mode.dtensor))
    (plain, _), (sharded, calls) = counts
    return (sharded - plain) / max(1, calls)


def measure(*, calls: int = 10) -> float:
    """Host seconds per DTensor call (needs a process without a process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    plain = _seconds(_stepper(_model(), tp=1), calls=calls)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        sharded = _stepper(_sharded(DeviceMesh.from_group(dist.group.WORLD, "cpu")), tp=2)
        tp = _seconds(sharded, calls=calls)
        with DTensorCalls() as mode:
            sharded()
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
