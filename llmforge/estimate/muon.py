"""Muon in the estimate (``optim.name=muon``, llmforge.train.muon): its state and its step.

State: one fp32 momentum buffer per Muon matrix (4 bytes per element) instead of
AdamW's two moments (8); the other parameters keep AdamW's. Step: the Newton-Schulz
iterations (``steps`` x (4 m^2 n + 2 m^3) FLOPs per m x n matrix, m <= n) and the
traffic that brings each matrix whole to one rank (llmforge.parallel.orthogonalize):

- held whole (no ZeRO shard, no TP split; expert weights split over experts): no
  traffic, every rank orthogonalises its own matrices; expert weights that ZeRO cuts inside
  each expert (``expert_shard_dim`` > 0: fewer local experts than ranks sharing them) take
  the owner route below over the expert group, a rank's whole stack at a time;
- sharded over one group of n ranks (ZeRO or TP): each rank orthogonalises 1/n of
  the group's matrices; the gather to the owners and the scatter back move
  ``(n - 1) / n^2`` of the matrices' fp32 bytes per rank each way, plus two
  latencies per matrix;
- sharded over both (ZeRO with TP): all-gathered over one of the two groups (the data-
  parallel one for column-parallel weights, the smaller for row-parallel ones), then as
  above over the other.

Imports no torch.
"""

from __future__ import annotations

import dataclasses

from llmforge.config.choices import Optimizer
from llmforge.estimate import comm as cm
from llmforge.estimate import kernels as kn
from llmforge.estimate.inventory import Inventory
from llmforge.estimate.params import Tensor, stage_tensors
from llmforge.estimate.shape import Job
from llmforge.layout import Layout, expert_shard_dim

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MUON_STATE_BYTES = 4  # momentum_buffer, fp32
FP32 = 4


def is_muon(t: Tensor) -> bool:
    """A block's weight matrix (as llmforge.train.muon.is_muon_matrix): not an embedding, the head, a norm or a router."""
    return len(t.shape) >= 2 and not t.name.startswith(("embed", "pos_embed", "head")) and "norm" not in t.name and "router" not in t.name


def _stage_key(layout: Layout, stage: int) -> tuple[int, int, tuple[int, ...] | None, int, bool]:
    """What selects a pipeline rank's tensors (llmforge.estimate.params.stage_tensors)."""
    return (layout.pp, layout.pp_virtual_stages, layout.pp_layers, stage, layout.v_shape)


def _tensors(inv: Inventory, stage: int) -> tuple[Tensor, ...]:
    """The tensors Muon steps on ``stage`` (in the inventory's memo: the search asks per layout)."""
    key = ("muon tensors", _stage_key(inv.layout, stage))
    found = inv.memo.get(key)
    if not isinstance(found, tuple):
        found = inv.memo[key] = tuple(t for t in stage_tensors(inv.shape, key[1]) if is_muon(t))
    return found


def _local_numel(t: Tensor, layout: Layout) -> float:
    n = 1
    for d in t.local_shape(layout.tp):
        n *= d
    return n / layout.ep if t.expert else n


def _muon_share(inv: Inventory, stage: int) -> float:
    """Share of the stage rank's parameters that Muon steps."""
    layout = inv.layout
    key = ("muon share", _stage_key(layout, stage), layout.tp, layout.ep)
    found = inv.memo.get(key)
    if not isinstance(found, float):
        total = sum(_local_numel(t, layout) for t in stage_tensors(inv.shape, key[1]))
        found = inv.memo[key] = sum(_local_numel(t, layout) for t in _tensors(inv, stage)) / total if total else 0.0
    return found


def state_bytes_per_param(inv: Inventory, job: Job, stage: int) -> float:
    """Optimizer-state bytes per parameter of pipeline rank ``stage`` (8 under AdamW)."""
    if job.optimizer != Optimizer.MUON:
        return ADAM_STATE_BYTES
    share = _muon_share(inv, stage)
    return MUON_STATE_BYTES * share + ADAM_STATE_BYTES * (1 - share)


def optimizer_bytes(adam_bytes: float, inv: Inventory, job: Job, stage: int) -> float:
    """The optimizer state of ``stage``'s rank, from what AdamW would keep there."""
    return adam_bytes * state_bytes_per_param(inv, job, stage) / ADAM_STATE_BYTES


def _ns_seconds(sp: kn.Speeds, t: Tensor, steps: int, matrices: float) -> float:
    m, n = sorted(t.shape[-2:])
    one = sp.gemm(m, n, m).plus(sp.gemm(m, m, m)).plus(sp.gemm(m, m, n)).seconds
    return steps * one * matrices


def step_seconds(inv: Inventory, job: Job, stage: int) -> float:
    """Newton-Schulz and its gathers and scatters per step on ``stage``'s rank (0 under AdamW)."""
    if job.optimizer != Optimizer.MUON:
        return 0.0
    layout = inv.layout
    sp = kn.speeds(dataclasses.replace(job, param_dtype=job.muon_ns_dtype))
    zero_group = layout.dp_shard * layout.cp if layout.zero > 0 else 1
    compute, traffic, gathered, ops = 0.0, 0.0, 0.0, 0
    for t in _tensors(inv, stage):
        count = t.shape[0] if len(t.shape) == 3 else 1
        if t.expert:
            local_experts, expert_group = count // layout.ep, max(1, zero_group // layout.ep)
            if expert_group == 1 or expert_shard_dim((local_experts, *t.shape[1:]), group=expert_group) == 0:
                # whole experts on each rank: ZeRO splits them over the expert group
                compute += _ns_seconds(sp, t, job.muon_ns_steps, -(-local_experts // expert_group))
            else:  # each expert cut inside: the rank's stack goes whole to one owner of the group and back
                compute += _ns_seconds(sp, t, job.muon_ns_steps, local_experts) / expert_group
                traffic += 2 * FP32 * t.numel / layout.ep * (expert_group - 1) / expert_group**2
                ops += 2
            continue
        groups = [g for g in (layout.tp if t.split != "rep" else 1, zero_group) if g > 1]
        if not groups:
            compute += _ns_seconds(sp, t, job.muon_ns_steps, count)
        elif len(groups) == 1:
            compute += _ns_seconds(sp, t, job.muon_ns_steps, count) / groups[0]
            traffic += 2 * FP32 * t.numel * (groups[0] - 1) / groups[0] ** 2
            ops += 2
        else:  # ZeRO with TP: gathered over one dimension, owned over the other
            kept = layout.tp if t.split == "col" else max(groups)  # FSDP2 strides its shards of column-parallel weights
            other = layout.tp * zero_group // kept
            compute += _ns_seconds(sp, t, job.muon_ns_steps, count) / kept
            gathered += FP32 * t.numel / kept * (other - 1) / other
            traffic += 2 * FP32 * t.numel * (kept - 1) / kept**2
            ops += 3
    span = layout.tp * zero_group
    moved = cm.seconds(job, traffic + gathered, span, max(layout.tp, zero_group))
    return compute + moved + cm.hops_seconds(job, ops)
