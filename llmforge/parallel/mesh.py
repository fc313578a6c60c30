"""The device mesh of a run: named dimensions built from the plan.

Ranks are laid out ``pp x dp x cp x tp`` with tp innermost, so tensor-parallel
groups sit on consecutive ranks (one node) and pipeline stages are furthest
apart. The data-parallel dimension is itself ``dp_rest x ep``: the experts of an
MoE layer are split over the innermost ``ep`` data-parallel ranks, and the
flattened ``dp`` dimension is what non-expert gradients are reduced over. An
expert shard is replicated over ``dp_rest`` (the data-parallel ranks with the same
ep coordinate): expert gradients are reduced, and ZeRO shards them, over it alone.
``dp_cp`` flattens ``dp_rest x ep x cp``: the ranks of one model replica's data and
context shards, over which dense gradients are averaged and ZeRO shards (``dp`` when
cp is 1).

With HSDP (``parallel.dp_replicate`` > 1) ``dp_rest`` is ``dp_replicate x dp_shard``
and ZeRO shards over the 2-D ``fsdp`` mesh ``(dp_replicate, dp_shard)``: FSDP2
shards over the inner ``dp_shard`` ranks (consecutive ranks: one node) and
replicates over ``dp_replicate`` (all-reducing gradients across it).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmforge.layout import Layout

DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
#: Until the first step is done, collectives may wait at least this long: data preparation
#: on rank 0, model build, torch.compile and checkpoint loading come before it.
FIRST_STEP_TIMEOUT_S = 600


@dataclass(frozen=True)
class ParallelMesh:
    """The world mesh and the sub-meshes each parallelism works over."""

    world: DeviceMesh
    dp: DeviceMesh
    dp_rest: DeviceMesh
    tp: DeviceMesh
    pp: DeviceMesh
    ep: DeviceMesh
    cp: DeviceMesh
    dp_cp: DeviceMesh
    #: What ZeRO 1-3 shard over: ``dp_cp``, or the 2-D ``(dp_replicate, dp_shard)`` mesh under HSDP.
    fsdp: DeviceMesh

    def size(self, name: str) -> int:
        return getattr(self, name).size()

    def local_rank(self, name: str) -> int:
        return getattr(self, name).get_local_rank()


def mesh_shape(layout: Layout) -> tuple:
    """The world mesh's size along each of ``DIMS``."""
    return (layout.pp, layout.dp_replicate, layout.dp // layout.ep // layout.dp_replicate, layout.ep, layout.cp, layout.tp)


def build_mesh(layout: Layout, *, device_type: str, timeout_s: float) -> ParallelMesh:
    """A mesh over every rank of the current process group, shaped by ``layout``; its
    groups get the first-step allowance of the collective timeout ``timeout_s``."""
    world = init_device_mesh(device_type, mesh_shape(layout), mesh_dim_names=DIMS)
    dp = world["dp_replicate", "dp_shard", "ep"]._flatten("dp")
    dp_rest = world["dp_replicate", "dp_shard"]._flatten("dp_rest") if layout.ep > 1 else dp
    dp_cp = world["dp_replicate", "dp_shard", "ep", "cp"]._flatten("dp_cp") if layout.cp > 1 else dp
    fsdp = world["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else dp_cp
    mesh = ParallelMesh(
        world=world, dp=dp, dp_rest=dp_rest, tp=world["tp"], pp=world["pp"], ep=world["ep"], cp=world["cp"], dp_cp=dp_cp, fsdp=fsdp
    )
    set_collective_timeout(mesh, seconds=first_step_timeout(timeout_s))
    return mesh


def first_step_timeout(timeout_s: float) -> float:
    """Collective timeout until the first step is done (data preparation, build, compile)."""
    return max(timeout_s, FIRST_STEP_TIMEOUT_S)


def set_collective_timeout(mesh: ParallelMesh | None, *, seconds: float) -> None:
    """Give every process group of the run this collective timeout. Sub-groups are
    created with the backend's default (30 minutes on gloo, 10 on NCCL), not the world
    group's, so a rank stuck in a tp/pp/dp collective would otherwise wait that long."""
    from torch.distributed.distributed_c10d import _set_pg_timeout  # as torchtitan does

    if not dist.is_initialized():
        return
    groups = [None]
    if mesh is not None:
        groups += [g for f in dataclasses.fields(mesh) for g in getattr(mesh, f.name).get_all_groups()]
    seen = set()
    for group in groups:
        if id(group) in seen:
            continue
        seen.add(id(group))
        try:
            _set_pg_timeout(timedelta(seconds=seconds), group)
        except (RuntimeError, ValueError, AttributeError):  # a backend that cannot change it keeps its own
            pass


def device_for_rank(*, accelerator: str) -> torch.device:
    """cpu for cluster.accelerator=cpu, else the GPU of this local rank."""
    if accelerator == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def backend_for(device: torch.device) -> str:
    """The process group backend for ranks computing on ``device``.

    On GPUs the group carries both devices, as torchtitan's does: NCCL for CUDA
    tensors (every hot-path collective hands it tensors on the rank's GPU) and gloo
    for the CPU tensors that object collectives, barriers and checkpoint
    coordination (DCP) exchange."""
    return "gloo" if device.type == "cpu" else f"cpu:gloo,{device.type}:nccl"


def init_distributed(*, accelerator: str, timeout_s: float) -> torch.device:
    """Join the process group torchrun set up (see ``backend_for``). Collectives get
    the first-step allowance until the trainer tightens them to cluster.timeout_s after
    its first step (set_collective_timeout), so a stuck rank ends the job."""
    device = device_for_rank(accelerator=accelerator)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device), timeout=timedelta(seconds=first_step_timeout(timeout_s)))
    return device
