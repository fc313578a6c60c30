"""Apply every parallelism to a model in the documented order, and build a rank's
components for a distributed run.

Order (as in torchtitan): float8 -> tensor parallel -> expert parallel -> context
parallel -> activation recompute -> compile -> FSDP (over dp x cp). The model is
built whole (or as its pipeline chunks) with the seeded initial weights first and
sharded afterwards, so every layout starts from the same numbers. A single
process goes through the same function with every degree 1 (no mesh).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from llmforge.parallel.clip import GlobalClip
from llmforge.parallel.compile import apply_compile
from llmforge.parallel.recompute import apply_recompute
from llmforge.parallel.context import apply_cp, cp_positions
from llmforge.parallel.data import FIRST_BUCKET_BYTES, BucketedGradReduce, GradAllReduce, apply_fsdp, fsdp_sync, grad_sync
from llmforge.parallel.expert import apply_ep, expert_parameters
from llmforge.parallel.mesh import ParallelMesh
from llmforge.parallel.pipeline import PipelineStep, autocast_forward, build_schedule, build_stage_model, stage_ids
from llmforge.parallel.tensor import apply_tp, loss_context, align_grads, sharded_cross_entropy
from llmforge.parallel.tied import TiedEmbeddingSync, tied_group, tied_params
from llmforge.plan import RunPlan
from llmforge.train.components import Components, RankInfo
from llmforge.train.optim import build_optimizer, build_scheduler
from llmforge.train.precision import DTYPES
from llmforge.train.step import GradAccumulationStep, cross_entropy


def parallelize(model: nn.Module, *, plan: RunPlan, mesh: Optional[ParallelMesh]) -> None:
    """Shard one model (or pipeline chunk) in place: float8 -> TP -> EP -> CP -> recompute -> compile -> FSDP.
    ``mesh`` may be None in one process, where only float8, recompute and compile apply."""
    p = plan.config.parallel
    if plan.config.precision.fp8:
        from llmforge.parallel.float8 import apply_float8

        apply_float8(model, recipe=plan.config.precision.fp8_recipe, emulate=plan.config.precision.fp8_emulate, fsdp_all_gather=fp8_all_gather(plan, mesh=mesh))
    if plan.tp > 1:
        apply_tp(model, tp_mesh=mesh.tp, sequence_parallel=p.sequence_parallel)
    if plan.ep > 1:
        apply_ep(model, ep_mesh=mesh.ep)
    if plan.cp > 1:
        apply_cp(model, cp_mesh=mesh.cp)
    if p.recompute != "none":
        apply_recompute(model, mode=p.recompute, every=p.recompute_every)
    if plan.config.train.compile:
        apply_compile(model)
    if uses_fsdp(plan, mesh=mesh):
        experts = mesh.dp_rest if plan.ep > 1 else None
        precision = plan.config.precision
        apply_fsdp(model, dp_mesh=mesh.fsdp, zero=p.zero, param_dtype=precision.param_dtype,
                   reduce_dtype=precision.reduce_dtype, expert_mesh=experts)


def uses_fsdp(plan: RunPlan, *, mesh: Optional[ParallelMesh]) -> bool:
    """ZeRO 1-3 on a distributed rank that reduces over its data-parallel group: FSDP2 shards the model."""
    return plan.config.parallel.zero > 0 and mesh is not None and reduces_over_dp(plan)


def fp8_all_gather(plan: RunPlan, *, mesh: Optional[ParallelMesh]) -> bool:
    """Float8 all-gather of FSDP-sharded weights: tensorwise fp8 under FSDP, unless turned off."""
    precision = plan.config.precision
    return precision.fp8 and precision.fp8_recipe == "tensorwise" and precision.fp8_all_gather and uses_fsdp(plan, mesh=mesh)


def reduces_over_dp(plan: RunPlan) -> bool:
    """Whether a distributed rank shards (ZeRO) and reduces gradients and the loss
    over its data-parallel group: when dp x cp > 1, and also for a one-rank plan
    started through torchrun (``cluster.launcher=torchrun``), whose groups of one
    take the multi-GPU code path (FSDP2, bucketed all-reduce) so one GPU checks it."""
    return plan.dp * plan.cp > 1 or plan.world_size == 1


def build_parts(plan: RunPlan, *, mesh: ParallelMesh, device: torch.device) -> tuple[List[nn.Module], List[int]]:
    """This rank's model parts (the whole model, or its pipeline chunks), parallelized."""
    cfg = plan.config
    if plan.pp == 1:
        from llmforge.train.build import build_model

        ids, parts = [0], [build_model(plan, device=device)]
    else:
        ids = stage_ids(pp_rank=mesh.local_rank("pp"), pp=plan.pp, virtual=plan.virtual_stages, schedule=cfg.parallel.pp_schedule)
        parts = [
            build_stage_model(cfg.model, stage=s, layers_per_stage=plan.layers_per_stage, seed=cfg.train.seed, device=device)
            for s in ids
        ]
    for part in parts:
        parallelize(part, plan=plan, mesh=mesh)
    return parts, ids


def build_parallel(plan: RunPlan, *, rank: RankInfo, sampler: object) -> Components:
    """A rank's components for any layout; the loop runs them like a single process."""
    from llmforge.train.build import build_scaler

    cfg, mesh, device = plan.config, rank.mesh, rank.device
    parts, ids = build_parts(plan, mesh=mesh, device=device)
    num_stages = len(plan.layers_per_stage)
    copies = _tied_copies(plan, parts=parts, ids=ids, num_stages=num_stages)
    optimizer = build_optimizer(nn.ModuleList(parts), optim=cfg.optim, lr=cfg.train.lr)
    _no_decay(optimizer, copies)
    if fp8_all_gather(plan, mesh=mesh):
        from llmforge.parallel.float8 import precompute_scales

        precompute = precompute_scales(parts)
        optimizer.register_step_post_hook(lambda *_: precompute())
    scaler = build_scaler(plan)
    reducers = _zero0_reducers(plan, mesh=mesh, parts=parts, overlap=plan.pp == 1 and plan.overlap_grad_reduce)
    finish = _finish_hooks(plan, mesh=mesh, parts=parts, ids=ids, num_stages=num_stages, reducers=reducers)
    if plan.pp == 1:
        step = _accumulation_step(plan, mesh=mesh, model=parts[0], scaler=scaler, device=device, finish=finish, reducers=reducers)
    else:
        step = _pipeline_step(plan, mesh=mesh, parts=parts, ids=ids, scaler=scaler, device=device, finish=finish)
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    skip = {id(p) for p in copies if any(getattr(part, "head", None) is not None and p is part.head.weight for part in parts)}
    return Components(
        model_parts=parts,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, optim=cfg.optim, total_steps=cfg.train.steps),
        sampler=sampler,
        step=step,
        scaler=scaler,
        clip_grads=GlobalClip(params=params, ranks_per_stage=plan.world_size // plan.pp, skip=skip),
        rank=rank,
        tokens_per_step=plan.tokens_per_step,
    )


def _tied_copies(plan: RunPlan, *, parts: List[nn.Module], ids: List[int], num_stages: int) -> List[nn.Parameter]:
    if plan.pp == 1 or not plan.config.model.tie_embeddings:
        return []
    return tied_params(parts, first=0 in ids, last=num_stages - 1 in ids)


def _no_decay(optimizer: torch.optim.Optimizer, copies: List[nn.Parameter]) -> None:
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


def _bucket_bytes(plan: RunPlan) -> tuple[int, int]:
    """Bucket caps: ``parallel.bucket_mb`` and a first bucket of at most 1 MB."""
    cap = max(1, int(plan.config.parallel.bucket_mb * 2**20))
    return cap, min(cap, FIRST_BUCKET_BYTES)


def _zero0_reducers(plan: RunPlan, *, mesh: ParallelMesh, parts: List[nn.Module], overlap: bool) -> List:
    """ZeRO 0 gradient reductions over dp x cp (expert weights over their replicas
    only, divided by dp): bucketed and overlapped with backward when ``overlap``,
    else one flat all-reduce each after backward."""
    if not reduces_over_dp(plan) or plan.config.parallel.zero != 0:
        return []
    dtype = DTYPES[plan.config.precision.reduce_dtype]
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    experts = {id(p) for part in parts for p in expert_parameters(part)}
    groups = [([p for p in params if id(p) not in experts], mesh.dp_cp.get_group(), plan.dp * plan.cp)]
    if experts:
        groups.append(([p for p in params if id(p) in experts], mesh.dp_rest.get_group(), plan.dp))
    if not overlap:
        return [GradAllReduce(params=ps, group=g, size=n, dtype=dtype) for ps, g, n in groups]
    cap, first = _bucket_bytes(plan)
    return [BucketedGradReduce(params=ps, group=g, size=n, dtype=dtype, bucket_bytes=cap, first_bucket_bytes=first) for ps, g, n in groups]


def _finish_hooks(plan: RunPlan, *, mesh: ParallelMesh, parts: List[nn.Module], ids: List[int], num_stages: int, reducers: List):
    """What runs after a step's backward: the ZeRO-0 gradient reductions (the
    bucketed ones before the tensor-parallel gradient layout is fixed, which is the
    same sum as after it: both are linear), then the tied-embedding sync."""
    hooks = [r for r in reducers if isinstance(r, BucketedGradReduce)]
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    if plan.tp > 1:
        hooks.append(lambda: align_grads(params))
    hooks.extend(r for r in reducers if isinstance(r, GradAllReduce))
    if plan.pp > 1 and plan.config.model.tie_embeddings:
        schedule = plan.config.parallel.pp_schedule
        last_pp = stage_ids(pp_rank=0, pp=plan.pp, virtual=plan.virtual_stages, schedule=schedule)
        last_rank = 0 if num_stages - 1 in last_pp else (num_stages - 1) % plan.pp
        group = tied_group(mesh, first_pp=0, last_pp=last_rank)
        copies = tied_params(parts, first=0 in ids, last=num_stages - 1 in ids)
        hooks.append(TiedEmbeddingSync(params=copies, group=group))

    def finish() -> None:
        for hook in hooks:
            hook()

    return finish if hooks else None


def _dp_mean(mesh: ParallelMesh, size: int):
    """The mean of each rank's loss over the dp x cp ranks (equal token counts)."""

    def reduce(loss: torch.Tensor) -> torch.Tensor:
        loss = loss.detach().float().clone()
        torch.distributed.all_reduce(loss, group=mesh.dp_cp.get_group())
        return loss / size

    return reduce


def _accumulation_step(plan: RunPlan, *, mesh: ParallelMesh, model: nn.Module, scaler, device: torch.device, finish, reducers: Optional[List] = None) -> GradAccumulationStep:
    cfg = plan.config
    no_sync = None
    if reduces_over_dp(plan) and cfg.parallel.zero > 0:
        no_sync = lambda last: fsdp_sync(model, zero=cfg.parallel.zero, last=last)  # noqa: E731
    bucketed = [r for r in reducers or [] if isinstance(r, BucketedGradReduce)]
    if bucketed:
        no_sync = lambda last: grad_sync(bucketed, sync=last)  # noqa: E731
    positions = None
    if plan.cp > 1:
        positions = cp_positions(seq_len=cfg.model.seq_len, cp_rank=mesh.local_rank("cp"), cp=plan.cp, device=device)
    return GradAccumulationStep(
        model=model,
        micro_batch_size=cfg.train.micro_batch_size,
        param_dtype=cfg.precision.param_dtype,
        scaler=scaler,
        device=device,
        loss_fn=sharded_cross_entropy if plan.tp > 1 else cross_entropy,
        no_sync=no_sync,
        reduce_loss=_dp_mean(mesh, plan.dp * plan.cp) if reduces_over_dp(plan) else None,
        loss_context=lambda: loss_context(plan.tp),
        finish=finish,
        positions=positions,
    )


def _pipeline_step(plan: RunPlan, *, mesh: ParallelMesh, parts: List[nn.Module], ids: List[int], scaler, device: torch.device, finish) -> PipelineStep:
    cfg = plan.config
    num_stages = len(plan.layers_per_stage)
    for part in parts:
        autocast_forward(part, param_dtype=cfg.precision.param_dtype, device=device)
    step = PipelineStep(
        schedule=None,
        has_first=0 in ids,
        has_last=num_stages - 1 in ids,
        loss_fn=sharded_cross_entropy if plan.tp > 1 else cross_entropy,
        scaler=scaler,
        device=device,
        pp_group=mesh.pp.get_group(),
        dp_group=mesh.dp.get_group(),
        dp_size=plan.dp,
        context=lambda: loss_context(plan.tp),
        finish=finish,
        modules=list(parts),
    )
    step.schedule = build_schedule(
        name=cfg.parallel.pp_schedule,
        modules=parts,
        ids=ids,
        num_stages=num_stages,
        group=mesh.pp.get_group(),
        device=device,
        microbatches=plan.microbatches,
        loss_fn=step.scaled_loss,
    )
    return step
