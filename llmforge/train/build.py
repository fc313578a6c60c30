"""Build a rank's components from a plan, for every layout (one process included):
model parts, parallelism, optimizer, step runner, gradient clipping."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmforge.config.choices import Dtype, MoeBalance, Offload, Qat
from llmforge.estimate.core import Estimate, estimate_plan
from llmforge.estimate.cpu_memory import model_mmap_threshold
from llmforge.models.gpt import GPT
from llmforge.models.moe import moe_metrics, set_aux_loss_scale
from llmforge.parallel.clip import GlobalClip
from llmforge.parallel.expert import global_moe_metrics, load_reducer
from llmforge.parallel.materialize import materialize, seeded_values
from llmforge.parallel.mesh import ParallelMesh, build_mesh
from llmforge.parallel.pipeline import stage_skeleton, tied_copy_source
from llmforge.parallel.qat import switch_at
from llmforge.parallel.tied import tied_params
from llmforge.plan import RunPlan
from llmforge.processes.host_memory import keep_freed_memory
from llmforge.train.anomaly import AnomalyPolicy, StepGuard
from llmforge.train.build_step import build_step
from llmforge.train.callbacks import Callback
from llmforge.train.components import Components, RankInfo
from llmforge.train.guarded_step import GuardedOptimizerStep
from llmforge.train.meter import meter_for
from llmforge.train.model_updates import ExpertBiasUpdate, Fp8ScaleUpdate
from llmforge.train.optim import build_optimizer, build_scheduler
from llmforge.train.parallelize import fp8_all_gather, parallelize
from llmforge.train.precision import LossScaler


def build_components(
    plan: RunPlan, *, rank: RankInfo, sampler: object, val_sampler: object | None = None, estimate: Estimate | None = None
) -> Components:
    """This rank's components: ``rank.mesh`` is None in one process, the run's
    ParallelMesh on a distributed rank. The loop runs every layout the same way.
    ``val_sampler``: the held-out stream, or None when the run does not validate;
    ``estimate``: the run's one estimate, which the meter reads (None: estimated here)."""
    cfg, mesh, device = plan.config, rank.mesh, rank.device
    if device.type == "cpu":
        keep_freed_memory(model_mmap_threshold(plan.config.model, micro_batch=plan.layout.micro_batch_size))
    parts, ids = build_parts(plan, mesh=mesh, device=device)
    copies = _tied_copies(plan, parts=parts, ids=ids, num_stages=len(plan.layers_per_stage))
    optimizer = _optimizer(plan, parts=parts, copies=copies)
    scaler = build_scaler(plan)
    guard = StepGuard(anomaly_policy(plan), device=device)
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    skip = {id(p) for p in copies if any(getattr(part, "head", None) is not None and p is part.head.weight for part in parts)}
    moe_updates, moe_stats = wire_moe(plan, parts=parts, rank=rank, scaler=scaler, guard=guard)
    return Components(
        model_parts=parts,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, optim=cfg.optim, total_steps=cfg.train.steps),
        sampler=sampler,
        val_sampler=val_sampler,
        step=build_step(
            plan, mesh=mesh, parts=parts, ids=ids, tied=copies, scaler=scaler, device=device, eos_id=getattr(sampler, "eos_id", None)
        ),
        scaler=scaler,
        clip_grads=GlobalClip(
            params=params,
            ranks_per_stage=plan.world_size // plan.layout.pp,
            skip=skip,
            distributed=mesh is not None,
            device=device,
            group=_host_group(plan, device=device),
        ),
        rank=rank,
        tokens_per_step=plan.tokens_per_step,
        guard=guard,
        update=GuardedOptimizerStep(optimizer, scaler=scaler, guard=guard),
        meter=meter_for(estimate if estimate is not None else estimate_plan(plan), device=device),
        before_step=_qat_switch(plan, parts=parts),
        extra_metrics=moe_stats,
        callbacks=(*_fp8_scales(plan, mesh=mesh, parts=parts), *moe_updates),
    )


def anomaly_policy(plan: RunPlan) -> AnomalyPolicy:
    """train.anomaly and its companions, as the plain values the loop's guard takes."""
    t = plan.config.train
    return AnomalyPolicy(
        action=t.anomaly,
        max_skipped_steps=t.max_skipped_steps,
        max_rollbacks=t.max_rollbacks,
        rollback_lr_factor=t.rollback_lr_factor,
        spike_window=t.loss_spike_window,
        spike_sigma=t.loss_spike_sigma,
        spike_skip=t.loss_spike_skip,
    )


def distributed_rank(plan: RunPlan, *, device: torch.device) -> RankInfo:
    """This rank of a started process group, with the run's mesh."""
    import torch.distributed as dist

    mesh = build_mesh(plan.layout, device_type=device.type, timeout_s=plan.config.cluster.timeout_s)
    return RankInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), dp_rank=mesh.local_rank("dp"), dp_size=plan.dp, device=device, mesh=mesh
    )


def build_model(plan: RunPlan, *, device: torch.device) -> GPT:
    """The whole model, unsharded, with its seeded initial weights (identical for every layout)."""
    with torch.device("meta"):
        model = GPT(plan.config.model)
    materialize(model, device=device, values=seeded_values(model, seed=plan.config.train.seed))
    return model


def build_parts(plan: RunPlan, *, mesh: ParallelMesh | None, device: torch.device) -> tuple[list[nn.Module], list[int]]:
    """This rank's model parts (the whole model, or its pipeline chunks) and their chunk
    ids, parallelized. Each part is built on the meta device and sharded there; only
    this rank's shards are then allocated and given their initial values."""
    ids = [0] if plan.layout.pp == 1 else plan.layout.stage_ids(mesh.local_rank("pp"))
    parts = []
    for stage in ids:
        part = model_skeleton(plan, stage=stage)
        parallelize(part, plan=plan, mesh=mesh)
        aliases = tied_copy_source(plan.config.model, stage=stage, num_stages=len(plan.layers_per_stage))
        materialize(
            part,
            device=device,
            values=seeded_values(part, seed=plan.config.train.seed, aliases=aliases),
            param_device=torch.device("cpu") if plan.layout.offload == Offload.STATES else device,
        )
        parts.append(part)
    return parts, ids


def model_skeleton(plan: RunPlan, *, stage: int) -> GPT:
    """Pipeline chunk ``stage`` (the whole model without pipeline parallelism) on the meta device."""
    if plan.layout.pp == 1:
        with torch.device("meta"):
            return GPT(plan.config.model)
    return stage_skeleton(plan.config.model, stage=stage, layers_per_stage=plan.layers_per_stage)


def _host_group(plan: RunPlan, *, device: torch.device):
    """A gloo group over every rank for the norm of offloaded (host) gradients on GPU ranks;
    None where the default group carries host tensors already (CPU ranks) or there are none."""
    if plan.layout.offload != Offload.STATES or device.type == "cpu":
        return None
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def build_scaler(plan: RunPlan) -> LossScaler:
    precision = plan.config.precision
    return LossScaler(
        scale=precision.initial_loss_scale,
        growth_interval=precision.loss_scale_growth_interval,
        enabled=precision.param_dtype == Dtype.FP16,
    )


def _optimizer(plan: RunPlan, *, parts: list[nn.Module], copies: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over every part (a tied embedding's copies without decay)."""
    cfg = plan.config
    optimizer = build_optimizer(nn.ModuleList(parts), optim=cfg.optim, lr=cfg.train.lr, offloaded=plan.layout.offload == Offload.STATES)
    _no_decay(optimizer, copies)
    return optimizer


def _fp8_scales(plan: RunPlan, *, mesh: ParallelMesh | None, parts: list[nn.Module]) -> list[Callback]:
    """The float8 scales of FSDP-gathered weights, recomputed after each optimizer step."""
    return [Fp8ScaleUpdate(parts)] if fp8_all_gather(plan, mesh=mesh) else []


def _tied_copies(plan: RunPlan, *, parts: list[nn.Module], ids: list[int], num_stages: int) -> list[nn.Parameter]:
    if plan.layout.pp == 1 or not plan.config.model.tie_embeddings:
        return []
    return tied_params(parts, first=0 in ids, last=num_stages - 1 in ids)


def _no_decay(optimizer: torch.optim.Optimizer, copies: list[nn.Parameter]) -> None:
    """The last stage's copy of a tied embedding is updated as the embedding is: no decay."""
    target = next((g for g in optimizer.param_groups if g["weight_decay"] == 0), None)
    for group in optimizer.param_groups:
        moved = [p for p in group["params"] if any(p is c for c in copies)]
        if group["weight_decay"] > 0 and moved:
            if target is None:
                target = {**group, "params": [], "weight_decay": 0.0}
                optimizer.add_param_group(target)
            group["params"] = [p for p in group["params"] if all(p is not c for c in copies)]
            target["params"].extend(moved)


def _qat_switch(plan: RunPlan, *, parts: list[nn.Module]) -> Callable[[int], None]:
    """QAT's fake quantization switched on at ``precision.qat_start_step`` (from the start: nothing to do)."""
    precision = plan.config.precision
    if precision.qat != Qat.NONE and precision.qat_start_step > 1:
        return switch_at(parts, start_step=precision.qat_start_step)
    return lambda step: None


def wire_moe(
    plan: RunPlan, *, parts: list[nn.Module], rank: RankInfo, scaler: LossScaler, guard: StepGuard
) -> tuple[list[Callback], Callable[[], dict]]:
    """MoE models: scale the router losses' gradient like the main loss; return the routing
    bias update after each optimizer step (``model.moe.balance=bias``) and what reads the
    per-step MoE statistics. A pipeline schedule divides gradients by the microbatch count
    itself; the accumulation loop divides each loss by it."""
    if not plan.moe_layers:
        return [], lambda: {}
    per_loss = 1.0 if plan.layout.pp > 1 else 1.0 / plan.microbatches
    set_aux_loss_scale(parts, scale=lambda: (scaler.scale if scaler.enabled else 1.0) * per_loss)
    moe = plan.config.model.moe
    updates: list[Callback] = []
    if moe.balance == MoeBalance.BIAS:
        reduce = load_reducer(rank.mesh) if rank.mesh is not None and plan.dp * plan.layout.cp > 1 else None
        updates.append(ExpertBiasUpdate(model_parts=tuple(parts), rate=moe.bias_update_rate, gate=guard.gate, reduce=reduce))
    if rank.mesh is not None:
        return updates, lambda: global_moe_metrics(parts)
    return updates, lambda: moe_metrics(parts)
