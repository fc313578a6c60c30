"""The host cost of parallelism per call, measured in a process of its own:

    python -m llmforge.calibrate.host_probe     # prints the microseconds (JSON)

Tensor parallelism: a one-block GPT a few elements wide (embedding, attention, MLP, tied output
layer and loss: the layers a tensor-parallel step runs, ``llmforge.parallel.tensor`` sharding
them as it shards a run's model) runs forward, backward and the for-loop AdamW step of CPU ranks
on a fake process group of two ranks (collectives return at once), and the same model unsharded.
The tensors are tiny, so the difference of the two is host work: DTensor's dispatch and
sharding propagation, the parallel styles' hooks, wrapping and unwrapping, redistributions,
the vocabulary-parallel loss. Divided by the DTensor calls the sharded step makes (as
``llmforge.rehearse.counts`` counts them), it is the profile's ``dtensor_op_us``, what
``llmforge.estimate.host`` charges per call: a call costs what it costs in a real step's mix
of calls, not in a pair of bare linears (whose calls are cheaper: fewer Python calls and
nested operators each).

FSDP2: GPTs as wide, of 2 and 4 blocks, run 1, 2 and 4 microbatches a step under ZeRO 1 and
ZeRO 3 (``llmforge.parallel.data.apply_fsdp`` over the same fake group) and unsharded. What each
sharded step adds is host work too, and three costs describe it (``llmforge.calibrate.fit.
fit_fsdp_host``): FSDP2's hooks, per unit (a block, or the root) and microbatch; each gather's
and reduce-scatter's own (copies in and out of the flat buffer, the collective's call), per
collective; and the for-loop AdamW and the clip on DTensor parameters, per parameter. They are
the profile's ``fsdp_unit_us``, ``fsdp_collective_us`` and ``fsdp_param_us``
(``llmforge.estimate.host.fsdp_host_seconds``).

Times are this thread's CPU time (waiting for a core on a shared machine is left out), the
fastest of a few rounds. Its own process: the fake group must be the default one, and a
calibrating rank has its real one.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmforge.calibrate.fit import FsdpSample, fit_fsdp_host
from llmforge.config.schema import ModelConfig
from llmforge.models.gpt import GPT, parameter_groups
from llmforge.parallel.clip import GlobalClip
from llmforge.parallel.data import apply_fsdp, fsdp_sync
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


def _seconds(step: Callable[[], None], *, calls: int, rounds: int = ROUNDS) -> float:
    best = float("inf")
    for _ in range(rounds):
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


#: The FSDP2 probes: (blocks, microbatches) under each ZeRO stage in ``FSDP_STAGES``, each step
#: timed ``FSDP_CALLS`` times in each of ``FSDP_ROUNDS`` rounds.
FSDP_SHAPES = ((2, 1), (2, 4), (4, 1), (4, 4))
FSDP_STAGES = (1, 3)
FSDP_CALLS, FSDP_ROUNDS = 3, 3


def _fsdp_model_config(*, blocks: int) -> ModelConfig:
    return ModelConfig(**{**TINY, "num_layers": blocks})


def _fsdp_stepper(*, blocks: int, microbatches: int, zero: int, mesh) -> Callable[[], None]:
    """One step of a GPT of ``blocks`` blocks, a few elements wide, as a CPU rank runs it:
    ``microbatches`` forward and backward passes (ZeRO 1 and 2 reduce in the last one only), the
    global clip and the for-loop AdamW; ``zero`` 0: unsharded."""
    torch.manual_seed(0)
    model = GPT(_fsdp_model_config(blocks=blocks))
    if zero:
        apply_fsdp(model, dp_mesh=mesh, zero=zero, param_dtype=torch.float32, reduce_dtype=torch.float32)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay=0.1), lr=1e-3, foreach=False)
    clip = GlobalClip(params=params, ranks_per_stage=2 if zero else 1, distributed=bool(zero))
    tokens = _tokens()

    def step() -> None:
        for index in range(microbatches):
            last = index == microbatches - 1
            with fsdp_sync(model, zero=zero, last=last) if zero else contextlib.nullcontext():
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(0, 1)).backward()
        clip(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return step


def fsdp_samples(mesh) -> list[FsdpSample]:
    """The host seconds each FSDP2 probe's step adds to the unsharded one's, on ``mesh``."""
    out = []
    for blocks, microbatches in FSDP_SHAPES:
        params = sum(1 for _ in GPT(_fsdp_model_config(blocks=blocks)).parameters())

        def timed(zero: int, blocks: int = blocks, microbatches: int = microbatches) -> float:
            step = _fsdp_stepper(blocks=blocks, microbatches=microbatches, zero=zero, mesh=mesh)
            return _seconds(step, calls=FSDP_CALLS, rounds=FSDP_ROUNDS)

        plain = timed(0)
        for zero in FSDP_STAGES:
            out.append(FsdpSample(blocks=blocks, microbatches=microbatches, zero=zero, params=params, seconds=timed(zero) - plain))
    return out


def measure(*, calls: int = 10) -> dict[str, float]:
    """Host seconds per DTensor call (``dtensor_op``) and FSDP2's three costs (``fsdp_unit``,
    ``fsdp_collective``, ``fsdp_param``); needs a process without a process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    plain = _seconds(_stepper(_model(), tp=1), calls=calls)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        sharded = _stepper(_sharded(mesh), tp=2)
        tp = _seconds(sharded, calls=calls)
        with DTensorCalls() as mode:
            sharded()
        fsdp = fit_fsdp_host(fsdp_samples(mesh))
    finally:
        dist.destroy_process_group()
    return {"dtensor_op": max(0.0, tp - plain) / max(1, mode.dtensor), **fsdp}


def in_subprocess(*, timeout_s: float = 120.0) -> dict[str, float]:
    """``measure`` in a fresh one-thread process (seconds by name); empty where it cannot run."""
    import json
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "llmforge.calibrate.host_probe"], env=env, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            return {}
        return {name: float(us) * 1e-6 for name, us in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, AttributeError):
        return {}


if __name__ == "__main__":
    import json

    print(json.dumps({name: round(seconds * 1e6, 3) for name, seconds in measure().items()}))
