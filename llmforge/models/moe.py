"""Mixture-of-experts feed-forward layer (``model.moe.*``).

``MoE`` replaces a block's MLP. Each token is routed by a softmax router to its
``top_k`` experts; the experts' outputs are summed with the routing weights
(renormalised over the chosen k when ``normalize_top_k``). Shared experts (one
MLP of ``num_shared_experts x ffn_hidden_size``) see every token.

Experts run as groups: their weights are stacked (``experts.w_up`` /
``w_gate`` ``[E, hidden, ffn]``, ``w_down`` ``[E, ffn, hidden]``), tokens are
sorted by expert, and one grouped matmul computes all experts at once from the
experts' offsets on the device (``expert_mlp``).

Two auxiliary losses train the router:

- the Switch/GShard load-balancing loss ``E * sum_e f_e * P_e`` (``f_e`` share
  of routed assignments that picked expert e, ``P_e`` mean router probability
  of e; 1.0 when perfectly balanced), times ``aux_loss_coef``;
- the ST-MoE router z-loss ``mean(logsumexp(logits)^2)``, times ``z_loss_coef``.

They never appear in the returned loss. With ``model.moe.balance=bias`` the load-balancing
loss is not applied; instead a per-expert bias (a buffer, saved in checkpoints) is added to
the router probabilities when choosing the top-k experts, and :func:`update_expert_bias`
moves it toward an even load after every optimizer step (DeepSeek-V3's auxiliary-loss-free
balancing). ``balance=none`` applies neither. ``AuxLossInjector`` passes the layer's
output through unchanged and, in backward, adds ``scale`` times the gradient of
the weighted aux losses (Megatron's MoEAuxLossAutoScaler). This works on any
pipeline stage, where only the last stage computes the loss. The step runner
sets ``scale`` with :func:`set_aux_loss_scale` to what it multiplies the main
loss by before backward (``1 / microbatches``, times the fp16 loss scale).

With ``capacity_factor`` set, expert capacity is
``ceil(capacity_factor * tokens * top_k / num_experts)`` per forward; the
assignments past it are dropped in GShard order (every token's first choice
before any token's second choice, then token order). A dropped assignment
contributes nothing (the token keeps its residual and the shared experts).

Balanced routing (``llmforge.models.balanced``) fixes the routing to a perfectly balanced
pattern whose shapes follow from the token count alone (rehearsals on fake tensors).

Each MoE layer keeps per-step statistics; :func:`moe_metrics` reads and resets
them. The module holds no ``torch.distributed``: expert parallelism swaps the
experts' forward from outside (``llmforge.parallel.expert``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from llmforge.blockspec.block import describe
from llmforge.blockspec.dims import dims_of
from llmforge.config.choices import Activation, MoeBalance
from llmforge.config.schema import ModelConfig
from llmforge.models import balanced
from llmforge.models.layers import MLP, linear


class AuxLossInjector(torch.autograd.Function):
    """Identity on ``output``; backward also sends ``scale`` as the gradient of ``aux_loss``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad_output, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def expert_counts(experts: torch.Tensor, *, num_experts: int) -> torch.Tensor:
    """[E] assignments per expert in ``experts`` (``bincount`` with a shape known without the values)."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


Counts = torch.Tensor | Sequence[int]


def expert_mlp(x: torch.Tensor, counts: Counts, *, w_up: torch.Tensor, w_gate: torch.Tensor | None, w_down: torch.Tensor) -> torch.Tensor:
    """Run every expert on its tokens.

    ``x`` [N, h] holds tokens sorted by expert, ``counts`` [E] how many each expert
    has (summing to N; a list of ints under balanced routing). Returns [N, h] in the same order.
    Grouped matmuls (``torch._grouped_mm``) take the experts' boundaries as device offsets, so the
    host never reads the counts; where they cannot run (or under selective checkpointing), the
    tokens are padded into an ``[E, capacity, h]`` buffer for batched matmuls, whose capacity is
    read from the device."""
    weights = [w for w in (w_up, w_gate, w_down) if w is not None]
    if x.shape[0] == 0:
        return x.new_zeros(0, x.shape[-1]) + 0.0 * sum(w.sum() for w in weights)
    dtype = compute_dtype(x)
    x = x.to(dtype)
    w_up, w_down = w_up.to(dtype), w_down.to(dtype)
    w_gate = w_gate.to(dtype) if w_gate is not None else None
    capacity = None if isinstance(counts, torch.Tensor) else max(counts)  # known on the host under balanced routing
    counts = counts if isinstance(counts, torch.Tensor) else torch.tensor(list(counts), device=x.device)
    if grouped_mm_fits(x, weights) and not selective_checkpointing():
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        up = torch._grouped_mm(x, w_up, offs=offsets)
        act = F.silu(torch._grouped_mm(x, w_gate, offs=offsets)) * up if w_gate is not None else F.gelu(up, approximate="tanh")
        return torch._grouped_mm(act, w_down, offs=offsets)
    return _padded_expert_mlp(x, counts, capacity=capacity, w_up=w_up, w_gate=w_gate, w_down=w_down)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (as it would cast a
    batched matmul), else ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def selective_checkpointing() -> bool:
    """Whether op-level selective checkpointing records or replays this forward. Its save list
    keeps batched matmuls' outputs and not yet grouped ones, so the experts run batched there.
    Compiling, it answers False: the batched path's host read would break the graph."""
    if torch.compiler.is_compiling():
        return False
    try:
        from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    except ImportError:
        return False
    modes = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    return any(isinstance(m, (_CachingTorchDispatchMode, _CachedTorchDispatchMode)) for m in modes)


def grouped_mm_fits(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether ``torch._grouped_mm`` runs these shapes: the torch version has it, every row
    (hidden and expert widths) is a multiple of 16 bytes, and the dtype is bf16 where only its
    shape function runs (compiling, fake or meta tensors: it accepts bf16 alone; its kernels
    take fp32 and fp16 too)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    shapes_only = torch.compiler.is_compiling() or is_fake(x) or x.device.type == "meta"
    if shapes_only and x.dtype != torch.bfloat16:
        return False
    return all((w.shape[-1] * x.element_size()) % 16 == 0 and (w.shape[-2] * x.element_size()) % 16 == 0 for w in weights)


def _padded_expert_mlp(
    x: torch.Tensor, counts: torch.Tensor, *, capacity: int | None, w_up: torch.Tensor, w_gate: torch.Tensor | None, w_down: torch.Tensor
) -> torch.Tensor:
    """``expert_mlp`` as batched matmuls over an ``[E, capacity, h]`` buffer (a capacity not given is read on the host)."""
    num_experts, hidden = w_up.shape[0], x.shape[-1]
    capacity = int(counts.max()) if capacity is None else capacity
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts, output_size=x.shape[0])
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert_ids]
    buf = x.new_zeros(num_experts, capacity, hidden).index_put((expert_ids, slot), x)
    up = torch.bmm(buf, w_up)
    if w_gate is not None:
        act = F.silu(torch.bmm(buf, w_gate)) * up
    else:
        act = F.gelu(up, approximate="tanh")
    return torch.bmm(act, w_down)[expert_ids, slot]


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs with stacked weights; forward(x sorted by expert, counts [E])."""

    def __init__(self, *, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size)) if activation == Activation.SWIGLU else None
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))

    def forward(self, x: torch.Tensor, counts: Counts) -> torch.Tensor:
        return expert_mlp(x, counts, w_up=self.w_up, w_gate=self.w_gate, w_down=self.w_down)


@dataclass
class Routing:
    """One forward's routing decision over T tokens."""

    weights: torch.Tensor  # [T, k] combine weights
    experts: torch.Tensor  # [T, k] expert ids
    keep: torch.Tensor  # [T, k] bool, False where capacity dropped the assignment
    probs: torch.Tensor  # [T, E] router softmax (fp32)
    logits: torch.Tensor  # [T, E] router logits (fp32)


def capacity_of(*, tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """Assignments one expert accepts per forward, or None (dropless)."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def capacity_keep(experts: torch.Tensor, *, num_experts: int, capacity: int | None) -> torch.Tensor:
    """[T, k] mask of kept assignments: each expert takes the first ``capacity`` in
    choice-major order (all first choices, then all second choices, ...)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    choice_major = experts.t().reshape(-1)
    onehot = F.one_hot(choice_major, num_experts)
    position = (torch.cumsum(onehot, 0) - 1).gather(1, choice_major[:, None]).squeeze(1)
    return (position < capacity).view(experts.shape[1], experts.shape[0]).t()


def route(logits: torch.Tensor, *, top_k: int, normalize: bool, capacity: int | None, bias: torch.Tensor | None = None) -> Routing:
    """Top-k softmax routing of [T, E] logits, with capacity dropping. A per-expert
    ``bias`` [E] is added to the probabilities to choose the experts only; the
    combine weights stay the unbiased probabilities (DeepSeek-V3). Under
    ``balanced_routing`` the experts are the fixed balanced pattern."""
    logits = logits.float()
    probs = logits.softmax(dim=-1)
    if balanced.active():
        tokens, num_experts = logits.shape
        experts = balanced.experts(tokens, top_k, num_experts, logits.device)
        weights = probs.gather(-1, experts)
        if normalize and top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        keep = balanced.keep(tokens, top_k, num_experts, capacity, logits.device)
        return Routing(weights=weights, experts=experts, keep=keep, probs=probs, logits=logits)
    if bias is None:
        weights, experts = probs.topk(top_k, dim=-1)
    else:
        experts = (probs + bias.float()).topk(top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
    if normalize and top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    keep = capacity_keep(experts, num_experts=logits.shape[-1], capacity=capacity)
    return Routing(weights=weights, experts=experts, keep=keep, probs=probs, logits=logits)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch/GShard loss ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

    ``f_e`` counts routed assignments before capacity dropping, as Switch does."""
    num_experts = routing.probs.shape[-1]
    counts = expert_counts(routing.experts, num_experts=num_experts).to(routing.probs.dtype)
    share = counts / routing.experts.numel()
    return num_experts * torch.sum(share * routing.probs.mean(dim=0))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean squared log-partition of the router logits."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class MoEStats:
    """Per-step sums over this layer's training forwards (detached, on the layer's device)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.forwards = 0
        self.aux = self.z = self.dropped = self.assigned = None
        self.counts: torch.Tensor | None = None

    def add(self, *, routing: Routing, aux: torch.Tensor, z: torch.Tensor) -> None:
        counts = expert_counts(routing.experts, num_experts=self.num_experts).detach()
        dropped = (~routing.keep).sum().detach()
        first = self.forwards == 0
        self.aux = aux.detach() if first else self.aux + aux.detach()
        self.z = z.detach() if first else self.z + z.detach()
        self.counts = counts if first else self.counts + counts
        self.dropped = dropped if first else self.dropped + dropped
        self.assigned = routing.experts.numel() + (0 if first else self.assigned)
        self.forwards += 1

    def summary(self) -> dict[str, float] | None:
        """Mean aux and z loss per forward, load imbalance (max / mean tokens per
        expert), coefficient of variation of the load, dropped share."""
        if self.forwards == 0:
            return None
        counts = self.counts.double()
        mean = counts.mean()
        return {
            "aux_loss": float(self.aux) / self.forwards,
            "z_loss": float(self.z) / self.forwards,
            "load_imbalance": float(counts.max() / mean),
            "load_cv": float(counts.std(unbiased=False) / mean),
            "dropped_frac": float(self.dropped) / self.assigned,
        }


def _in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. activation recomputation)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Routed experts plus optional shared experts; a drop-in for a block's MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe, spec = config.moe, describe(dims_of(config), moe=True)
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.normalize_top_k, self.capacity_factor = moe.normalize_top_k, moe.capacity_factor
        self.aux_loss_coef = moe.aux_loss_coef if moe.balance == MoeBalance.AUX else 0.0
        self.z_loss_coef = moe.z_loss_coef
        bias = moe.balance == MoeBalance.BIAS  # routing state: saved in checkpoints; the load since the last update is not
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts) if bias else None)
        self.register_buffer("expert_load", torch.zeros(moe.num_experts, dtype=torch.int64) if bias else None, persistent=False)
        self.router = linear(spec.linear("mlp.router"))
        experts = spec.experts
        assert experts is not None
        self.experts = GroupedExperts(
            num_experts=experts.num, hidden_size=experts.hidden, ffn_hidden_size=experts.ffn, activation=spec.activation
        )
        shared = spec.under("mlp.shared")
        self.shared: MLP | None = MLP(shared) if shared else None
        self.aux_loss_scale: Callable[[], float] = _one
        self.stats = MoEStats(moe.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        capacity = capacity_of(tokens=tokens.shape[0], top_k=self.top_k, num_experts=self.num_experts, capacity_factor=self.capacity_factor)
        routing = route(self.router(tokens), top_k=self.top_k, normalize=self.normalize_top_k, capacity=capacity, bias=self.expert_bias)
        out = self._dispatch_combine(tokens, routing)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(shape)
        if not self.training:
            return out
        aux, z = load_balancing_loss(routing), z_loss(routing.logits)
        if not _in_backward():
            self.stats.add(routing=routing, aux=aux, z=z)
            if self.expert_load is not None:
                self.expert_load += expert_counts(routing.experts, num_experts=self.num_experts)
        total = self.aux_loss_coef * aux + self.z_loss_coef * z
        if total.requires_grad:
            out = AuxLossInjector.apply(out, total, float(self.aux_loss_scale()))
        return out

    def reset_state(self, *, device: torch.device | None = None) -> None:
        """Zero the routing bias and load count (a fresh model's values), on ``device``
        (default: where they are)."""
        if self.expert_bias is not None:
            device = device or self.expert_bias.device
            self.expert_bias = torch.zeros(self.num_experts, device=device)
            self.expert_load = torch.zeros(self.num_experts, dtype=torch.int64, device=device)

    def _dispatch_combine(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Sort kept assignments by expert, run the experts, sum back with the routing weights."""
        if balanced.active():
            return self._balanced_dispatch_combine(tokens, routing)
        expert_of, weight = routing.experts.flatten(), routing.weights.flatten()
        token_of = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(self.top_k)
        if self.capacity_factor is not None:  # a boolean mask's size is read on the host: only where tokens drop
            keep = routing.keep.flatten()
            expert_of, weight, token_of = expert_of[keep], weight[keep], token_of[keep]
        order = torch.argsort(expert_of, stable=True)
        token_of, weight = token_of[order], weight[order]
        counts = expert_counts(expert_of, num_experts=self.num_experts)
        return self._run_experts(tokens, token_of, weight, counts)

    def _run_experts(self, tokens: torch.Tensor, token_of: torch.Tensor, weight: torch.Tensor, counts: Counts) -> torch.Tensor:
        y = self.experts(tokens[token_of], counts)
        y = y * weight[:, None].to(y.dtype)
        return tokens.new_zeros(tokens.shape).index_add(0, token_of, y.to(tokens.dtype))

    def _balanced_dispatch_combine(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``_dispatch_combine`` under balanced routing: which assignments each expert keeps is
        known from the token count, so every index is made without reading the routing."""
        count, E, k = tokens.shape[0], self.num_experts, self.top_k
        capacity = capacity_of(tokens=count, top_k=k, num_experts=E, capacity_factor=self.capacity_factor)
        assignment, counts = balanced.assignments(tokens=count, top_k=k, num_experts=E, capacity=capacity, device=tokens.device)
        return self._run_experts(tokens, assignment // k, routing.weights.flatten()[assignment], counts)


def _one() -> float:
    return 1.0


def moe_layers(model_parts: Iterable[nn.Module]) -> Iterable[tuple[str, MoE]]:
    """(name, layer) for every MoE layer in the model parts."""
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                yield name, module


def set_aux_loss_scale(model_parts: Iterable[nn.Module], *, scale: Callable[[], float]) -> None:
    """Set what the aux losses' gradient is multiplied by: the factor the step runner
    applies to the main loss before backward (read at each forward)."""
    for _, layer in moe_layers(model_parts):
        layer.aux_loss_scale = scale


@torch.no_grad()
def update_expert_bias(
    model_parts: Iterable[nn.Module],
    *,
    rate: float,
    reduce: Callable[[torch.Tensor], None] | None = None,
    step_scale: torch.Tensor | None = None,
) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3), run after each optimizer step: every
    expert's routing bias moves by ``rate * sign(mean load - load)``, the load being the
    tokens routed to it since the last update. ``reduce`` sums the [layers, E] counts in
    place over the ranks that routed other tokens, so every rank's bias stays identical.
    ``step_scale`` (a 0-dim device tensor) multiplies the move: 0 on a skipped step leaves the bias as it is."""
    layers = [layer for _, layer in moe_layers(model_parts) if layer.expert_bias is not None]
    if not layers:
        return
    loads = torch.stack([layer.expert_load for layer in layers])  # type: ignore[misc]
    if reduce is not None:
        reduce(loads)
    loads = loads.double()
    steps = torch.sign(loads.mean(dim=1, keepdim=True) - loads) * rate
    if step_scale is not None:
        steps = steps * step_scale
    for layer, step in zip(layers, steps, strict=False):
        layer.expert_bias += step.to(layer.expert_bias.dtype)  # type: ignore[operator]
        layer.expert_load.zero_()  # type: ignore[union-attr]


MOE_METRIC_KEYS = ("aux_loss", "z_loss", "load_imbalance", "load_cv", "dropped_frac")


def moe_metric_sums(model_parts: Iterable[nn.Module]) -> tuple[dict[str, float], int, float]:
    """Sums of each statistic over this rank's MoE layers that ran since the last
    call, how many layers that is, and the worst layer's load imbalance; resets them."""
    sums = dict.fromkeys(MOE_METRIC_KEYS, 0.0)
    count, worst = 0, 0.0
    for _, layer in moe_layers(model_parts):
        summary = layer.stats.summary()
        layer.stats.reset()
        if summary is None:
            continue
        count += 1
        worst = max(worst, summary["load_imbalance"])
        for key in MOE_METRIC_KEYS:
            sums[key] += summary[key]
    return sums, count, worst


def moe_metrics(model_parts: Iterable[nn.Module]) -> dict[str, float]:
    """MoE statistics since the last call, averaged over this rank's MoE layers, then reset.

    Keys: ``moe/aux_loss``, ``moe/z_loss``, ``moe/load_imbalance`` (max over mean
    tokens per expert, 1.0 is balanced), ``moe/max_load_imbalance`` (worst layer),
    ``moe/load_cv``, ``moe/dropped_frac``. Empty for a dense model."""
    sums, count, worst = moe_metric_sums(model_parts)
    return metrics_from_sums(sums, count=count, worst=worst)


def metrics_from_sums(sums: dict[str, float], *, count: int, worst: float) -> dict[str, float]:
    if count == 0:
        return {}
    out = {f"moe/{key}": value / count for key, value in sums.items()}
    out["moe/max_load_imbalance"] = worst
    return out
