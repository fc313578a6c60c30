"""What one rank really holds during a training step: model-state bytes
(weights, gradients, optimizer states) and the bytes one microbatch saves for
backward. The estimator's memory tests and ``tools/bench_zero.py`` compare these
with the estimate.

Runs one rank in this process on torch's fake process group (collectives do
nothing; shapes, dtypes and sharding are real) with the backend's own
``build_components``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from llmforge.parallel.dtensor import local
from llmforge.parallel.mesh import build_mesh
from llmforge.plan import RunPlan
from llmforge.train.build import build_components
from llmforge.train.callbacks import Callbacks
from llmforge.train.components import RankInfo
from llmforge.train.measure import cached_tensors, selective_caches
from llmforge.train.precision import autocast


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return local(t).untyped_storage()


def _fsdp_params(parts: list[nn.Module]) -> Iterator[object]:
    """FSDP2's record of every parameter it manages (shard, gathered copy, gradients)."""
    for unit in (m for part in parts for m in part.modules() if isinstance(m, FSDPModule)):
        group = unit._get_fsdp_state()._fsdp_param_group
        yield from group.fsdp_params if group is not None else []


def model_state_bytes(parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes alive on this rank, each storage once:
    the parameters or, under FSDP, their shards, gathered compute copies and gradients."""
    seen: set = set()

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None or _storage(t)._cdata in seen:
            return 0
        seen.add(_storage(t)._cdata)
        return _storage(t).nbytes()

    weights = grads = 0
    managed = list(_fsdp_params(parts))
    for fp in managed:
        weights += nbytes(fp.sharded_param)
        grads += nbytes(fp.sharded_param.grad) + nbytes(fp.unsharded_accumulated_grad)
        if hasattr(fp, "_unsharded_param"):
            weights += nbytes(fp._unsharded_param)
            grads += nbytes(fp._unsharded_param.grad)
    if not managed:
        params = [p for part in parts for p in part.parameters()]
        weights, grads = sum(nbytes(p) for p in params), sum(nbytes(p.grad) for p in params)
    states = sum(nbytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return weights, grads, states


def _weight_storages(parts: list[nn.Module]) -> set:
    """Storages of parameters, buffers and FSDP's gathered copies: not activations."""
    tensors = [t for part in parts for t in [*part.parameters(), *part.buffers()]]
    tensors += [fp._unsharded_param for fp in _fsdp_params(parts) if hasattr(fp, "_unsharded_param")]
    return {_storage(t)._cdata for t in tensors}


def measure_step(plan: RunPlan) -> tuple[tuple[int, int, int], int]:
    """Rank 0 on the fake group: one whole step and an optimizer step (so AdamW's
    moments exist), then the next step's first microbatch (of two) under the
    saved-tensors hooks. Returns the model-state bytes after that microbatch's
    backward, and the bytes it saved for backward."""
    with selective_caches() as caches:
        return _measure_on_fake_group(plan, caches)


def _measure_on_fake_group(plan: RunPlan, caches: list) -> tuple[tuple[int, int, int], int]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        cpu, cfg = torch.device("cpu"), plan.config
        c = build_components(
            plan,
            rank=RankInfo(device=cpu, mesh=build_mesh(plan.layout, device_type="cpu", timeout_s=plan.config.cluster.timeout_s)),
            sampler=None,
        )
        batch = torch.randint(0, cfg.model.vocab_size, (plan.config.train.global_batch_size // plan.dp, cfg.model.seq_len + 1))
        c.step(batch)
        c.optimizer.step()
        Callbacks(c.callbacks).after_update(1)
        c.optimizer.zero_grad(set_to_none=True)
        saved: dict = {}

        def pack(t):
            st = _storage(t)
            saved[st._cdata] = max(saved.get(st._cdata, 0), st.nbytes())
            return t

        caches.clear()
        step, mb = c.step, batch[: plan.layout.micro_batch_size].clone()
        no_sync = step.no_sync(False) if step.no_sync is not None else contextlib.nullcontext()
        with no_sync, step.loss_context():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with autocast(param_dtype=cfg.precision.param_dtype, device=cpu):
                    logits = step.model(mb[:, :-1])
                loss = step.loss_fn(logits, mb[:, 1:])
                for t in cached_tensors(caches):
                    pack(t)
            loss.backward()
        excluded = _weight_storages(c.model_parts)
        activations = sum(n for key, n in saved.items() if key not in excluded)
        return model_state_bytes(c.model_parts, c.optimizer), activations
    finally:
        dist.destroy_process_group()
