"""The optimizer (AdamW with decoupled weight decay, or Muon) and a warm-up + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from llmforge.config.choices import DecayShape, LrSchedule, Optimizer
from llmforge.config.schema import OptimConfig
from llmforge.models.gpt import parameter_groups
from llmforge.train.muon import build_muon


def implementation(params: list[nn.Parameter], *, offloaded: bool = False) -> str:
    """``fused`` where every parameter lives on a GPU (one kernel for the whole
    update, no host synchronisation) or is offloaded to host memory (torch's fused
    CPU AdamW: tools/bench_cpu_adamw.py measures it many times faster than the
    for-loop), else ``for-loop``: torch's own default on CPU, whose per-parameter
    update is elementwise-identical however the parameters are sharded, so every
    layout computes what one process does."""
    if params and (offloaded or all(p.device.type == "cuda" for p in params)):
        return "fused"
    return "for-loop"


def _split_by_mesh(groups: list[dict]) -> list[dict]:
    """One group per DeviceMesh: a fused update runs over tensors of a single mesh
    (expert weights live on another mesh than dense ones)."""
    out = []
    for group in groups:
        by_mesh: dict = {}
        for p in group["params"]:
            mesh = p.device_mesh if isinstance(p, DTensor) else None
            by_mesh.setdefault(id(mesh), []).append(p)
        out.extend({**group, "params": params} for params in by_mesh.values())
    return out


def build_optimizer(model: nn.Module, *, optim: OptimConfig, lr: float, offloaded: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters (``implementation`` picks fused or for-loop;
    ``offloaded``: the parameters are FSDP2-offloaded to host memory), or with
    ``optim.name=muon`` Muon for the blocks' matrices and AdamW for the rest
    (llmforge.train.muon)."""
    if optim.name == Optimizer.MUON:
        return build_muon(model, optim=optim, lr=lr)
    groups = [g for g in parameter_groups(model, weight_decay=optim.weight_decay) if g["params"]]
    kind = implementation([p for g in groups for p in g["params"]], offloaded=offloaded)
    options = {"fused": True} if kind == "fused" else {"foreach": False}
    if kind == "fused":
        groups = _split_by_mesh(groups)
    return torch.optim.AdamW(groups, lr=lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **options)


def lr_factor(step: int, *, optim: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak learning rate before optimizer step ``step`` (0-based)."""
    if optim.warmup_steps > 0 and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == LrSchedule.CONSTANT:
        return 1.0
    if optim.schedule == LrSchedule.WSD:
        decay_steps = max(1, round(optim.decay_fraction * total_steps))
        decay_start = max(optim.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * decay_shape(optim.decay_shape, progress)
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    shape = decay_shape("linear" if optim.schedule == LrSchedule.LINEAR else "cosine", progress)
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape


def decay_shape(shape: str, progress: float) -> float:
    """From 1 at progress 0 down to 0 at progress 1: linear, cosine or sqrt (1 - sqrt(progress))."""
    if shape == DecayShape.LINEAR:
        return 1.0 - progress
    if shape == DecayShape.SQRT:
        return 1.0 - math.sqrt(progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, optim: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim=optim, total_steps=total_steps))


def set_lr_scale(optimizer: torch.optim.Optimizer, scheduler, *, scale: float) -> None:
    """Peak learning rates = each group's initial one x ``scale``; the schedule goes on at its step."""
    base_lrs = [group["initial_lr"] * scale for group in optimizer.param_groups]
    scheduler.base_lrs = base_lrs
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(base_lrs, scheduler.lr_lambdas, strict=False)]
    for group, lr in zip(optimizer.param_groups, lrs, strict=False):
        group["lr"] = lr
    scheduler._last_lr = lrs  # type: ignore[attr-defined]
