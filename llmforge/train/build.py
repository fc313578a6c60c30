"""Build a rank's components from a plan: data, model, parallelism, optimizer."""

from __future__ import annotations

import torch

from llmforge.models.gpt import GPT
from llmforge.plan import RunPlan
from llmforge.parallel.clip import GlobalClip
from llmforge.train.components import Components, RankInfo
from llmforge.train.optim import build_optimizer, build_scheduler
from llmforge.train.precision import LossScaler
from llmforge.train.step import GradAccumulationStep


def build_model(plan: RunPlan, *, device: torch.device) -> GPT:
    """The full model with its seeded initial weights (identical for every layout)."""
    model = GPT(plan.config.model)
    model.init_weights(seed=plan.config.train.seed)
    return model.to(device)


def build_scaler(plan: RunPlan) -> LossScaler:
    precision = plan.config.precision
    return LossScaler(
        scale=precision.initial_loss_scale,
        growth_interval=precision.loss_scale_growth_interval,
        enabled=precision.param_dtype == "fp16",
    )


def build_single_process(plan: RunPlan, *, rank: RankInfo, sampler: object) -> Components:
    from llmforge.parallel.parallelize import parallelize

    cfg = plan.config
    model = build_model(plan, device=rank.device)
    parallelize(model, plan=plan, mesh=None)  # recompute and compile; every parallel degree is 1
    optimizer = build_optimizer(model, optim=cfg.optim, lr=cfg.train.lr)
    scaler = build_scaler(plan)
    step = GradAccumulationStep(
        model=model,
        micro_batch_size=cfg.train.micro_batch_size,
        param_dtype=cfg.precision.param_dtype,
        scaler=scaler,
        device=rank.device,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    return wire(plan, Components(
        model_parts=[model],
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, optim=cfg.optim, total_steps=cfg.train.steps),
        sampler=sampler,
        step=step,
        scaler=scaler,
        clip_grads=GlobalClip(params=params),
        rank=rank,
        tokens_per_step=plan.tokens_per_step,
    ))


def build_components(plan: RunPlan, *, rank: RankInfo, sampler: object) -> Components:
    """A single process's components, or a distributed rank's (``rank.mesh`` set)."""
    if rank.mesh is None:
        return build_single_process(plan, rank=rank, sampler=sampler)
    from llmforge.parallel.parallelize import build_parallel

    return wire(plan, build_parallel(plan, rank=rank, sampler=sampler))


def wire(plan: RunPlan, c: Components) -> Components:
    """What every run's components get once built: the step meter (MFU, peak memory), MoE wiring."""
    from llmforge.train.meter import meter_for

    c.meter = meter_for(plan, device=c.rank.device)
    return wire_moe(plan, c)


def wire_moe(plan: RunPlan, c: Components) -> Components:
    """MoE models: scale the router losses' gradient like the main loss, update the
    routing bias after each optimizer step (``model.moe.balance=bias``) and log the
    per-step MoE statistics. A pipeline schedule divides gradients by the
    microbatch count itself; the accumulation loop divides each loss by it."""
    if not plan.moe_layers:
        return c
    from llmforge.models.moe import moe_metrics, set_aux_loss_scale

    per_loss = 1.0 if plan.pp > 1 else 1.0 / plan.microbatches
    scaler = c.scaler
    set_aux_loss_scale(c.model_parts, scale=lambda: (scaler.scale if scaler.enabled else 1.0) * per_loss)
    moe = plan.config.model.moe
    if moe.balance == "bias":
        from llmforge.models.moe import update_expert_bias

        reduce = None
        if c.rank.mesh is not None and plan.dp * plan.cp > 1:
            from llmforge.parallel.expert import load_reducer

            reduce = load_reducer(c.rank.mesh)
        c.optimizer.register_step_post_hook(lambda *_: update_expert_bias(c.model_parts, rate=moe.bias_update_rate, reduce=reduce))
    if c.rank.mesh is not None:
        from llmforge.parallel.expert import global_moe_metrics

        c.extra_metrics = lambda: global_moe_metrics(c.model_parts)
    else:
        c.extra_metrics = lambda: moe_metrics(c.model_parts)
    return c
