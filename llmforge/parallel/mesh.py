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

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmforge.plan import RunPlan

DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


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


def build_mesh(plan: RunPlan, *, device_type: str) -> ParallelMesh:
    """A mesh over every rank of the current process group, shaped by the plan."""
    replicate = plan.config.parallel.dp_replicate
    shape = (plan.pp, replicate, plan.dp // plan.ep // replicate, plan.ep, plan.cp, plan.tp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    dp = world["dp_replicate", "dp_shard", "ep"]._flatten("dp")
    dp_rest = world["dp_replicate", "dp_shard"]._flatten("dp_rest") if plan.ep > 1 else dp
    dp_cp = world["dp_replicate", "dp_shard", "ep", "cp"]._flatten("dp_cp") if plan.cp > 1 else dp
    fsdp = world["dp_replicate", "dp_shard"] if replicate > 1 else dp_cp
    return ParallelMesh(world=world, dp=dp, dp_rest=dp_rest, tp=world["tp"], pp=world["pp"], ep=world["ep"], cp=world["cp"], dp_cp=dp_cp, fsdp=fsdp)


def device_for_rank(plan: RunPlan) -> torch.device:
    """cpu for cluster.accelerator=cpu, else the GPU of this local rank."""
    if plan.config.cluster.accelerator == "cpu":
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


def init_distributed(plan: RunPlan) -> torch.device:
    """Join the process group torchrun set up (see ``backend_for``), with the
    plan's collective timeout so a stuck rank ends the job instead of hanging it."""
    device = device_for_rank(plan)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device), timeout=timedelta(seconds=plan.config.cluster.timeout_s))
    return device
