"""Muon for the blocks' weight matrices, AdamW for everything else, in one optimizer.

Muon (Keller Jordan; Moonshot's "Muon is scalable"): a momentum buffer per matrix,
whose Nesterov look-ahead is orthogonalised by Newton-Schulz iterations
(llmforge.parallel.orthogonalize, which also spreads the work of sharded matrices
over their ranks), scaled by 0.2·sqrt(max(rows, cols)) so its RMS matches AdamW's
update, with decoupled weight decay. Embeddings, the output layer, norms, biases and
MoE routers keep AdamW (the same per-element update as torch.optim.AdamW, on each
rank's shard). State names: ``momentum_buffer`` for matrices; ``step``,
``exp_avg``, ``exp_avg_sq`` for the rest, as torch names them, so checkpoints
(llmforge.checkpoint.state) hold them like AdamW's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmforge.config.schema import OptimConfig
from llmforge.parallel.dtensor import local
from llmforge.parallel.orthogonalize import Matrix, orthogonalize

NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def is_muon_matrix(name: str, param: nn.Parameter) -> bool:
    """A weight matrix of a transformer block (expert weights ``[E, ...]`` included),
    not a norm or router."""
    return param.ndim >= 2 and "layers." in name and "norm" not in name and "router" not in name


def rms_scale(shape: torch.Size) -> float:
    """Moonshot's factor that gives the orthogonalised update AdamW's RMS."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def muon_groups(model: nn.Module, *, weight_decay: float, lr: float, adamw_lr: float) -> list[dict]:
    """Muon matrices (decayed); AdamW decayed (other matrices: the untied output layer)
    and undecayed (biases, norms, embeddings); empty groups dropped."""
    muon, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if is_muon_matrix(name, param):
            muon.append(param)
        elif param.ndim < 2 or "norm" in name or "embed" in name:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": muon, "weight_decay": weight_decay, "lr": lr, "muon": True},
        {"params": decay, "weight_decay": weight_decay, "lr": adamw_lr, "muon": False},
        {"params": no_decay, "weight_decay": 0.0, "lr": adamw_lr, "muon": False},
    ]
    return [g for g in groups if g["params"]]


class Muon(torch.optim.Optimizer):
    """Groups with ``muon: True`` step by Muon, the others by AdamW (for-loop, any layout)."""

    def __init__(self, groups: list[dict], *, optim: OptimConfig, lr: float) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=0.0,
            muon=False,
            momentum=optim.muon_momentum,
            nesterov=optim.muon_nesterov,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
        )
        super().__init__(groups, defaults)
        self.ns_steps = optim.muon_ns_steps
        self.ns_dtype = NS_DTYPES[optim.muon_ns_dtype]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices, owners = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["muon"]:
                    matrices.append(Matrix(local=self._momentum(p, group), like=p))
                    owners.append(group)
                else:
                    self._adamw(p, group)
        updates = orthogonalize(matrices, steps=self.ns_steps, dtype=self.ns_dtype)
        for m, group, update in zip(matrices, owners, updates, strict=False):
            weight = local(m.like)
            weight.mul_(1 - group["lr"] * group["weight_decay"])
            weight.add_(update.to(weight.dtype), alpha=-group["lr"] * rms_scale(m.like.shape))
        return loss

    def _momentum(self, p: nn.Parameter, group: dict) -> torch.Tensor:
        """Update the momentum buffer; return this rank's shard of what is orthogonalised."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf, grad = local(state["momentum_buffer"]), local(p.grad)
        buf.mul_(group["momentum"]).add_(grad)
        return grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf.clone()

    def _adamw(self, p: nn.Parameter, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        state["step"] += 1
        step = float(state["step"])
        weight, grad = local(p), local(p.grad)
        exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
        weight.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def build_muon(model: nn.Module, *, optim: OptimConfig, lr: float) -> Muon:
    adamw_lr = optim.adamw_lr if optim.adamw_lr is not None else lr
    groups = muon_groups(model, weight_decay=optim.weight_decay, lr=lr, adamw_lr=adamw_lr)
    return Muon(groups, optim=optim, lr=lr)
