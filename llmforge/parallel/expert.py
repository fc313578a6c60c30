"""Expert parallelism: each rank of the ``ep`` mesh dimension holds E/ep experts.

``apply_ep(model, *, ep_mesh)`` turns every MoE layer's stacked expert weights
(``mlp.experts.w_up`` / ``w_gate`` / ``w_down``, ``[E, ...]``) into DTensors
sharded on dim 0 over ``ep_mesh`` (names unchanged, so distributed checkpoints
reshard between ep degrees) and swaps the experts' forward for one that

1. exchanges per-expert token counts with an all-to-all,
2. sends each token to the rank holding its expert (autograd-aware all-to-all),
3. runs the local experts as one batched computation,
4. sends the results back with the reverse all-to-all.

Routing, capacity dropping, the aux losses and the weighted combine stay on the
token's own rank, so an ep run computes what ep=1 computes on the same tokens.

The ep ranks are data-parallel ranks that see different tokens. Gradients of
non-expert weights are averaged over all data-parallel ranks as usual. An expert
weight already receives the gradient from the tokens of every rank of its ep
group; it must be reduced only over the ranks holding a replica of the same
experts (the ``dp_rest`` mesh: same ep coordinate, other replica groups),
summed and divided by the full data-parallel size. The backend does that in
``llmforge.train.build_step`` (ZeRO 0: a ``GradAllReduce`` over ``dp_rest``
dividing by dp) and ``llmforge.parallel.data.apply_fsdp`` (ZeRO 1-3: the experts
in their own FSDP2 unit on ``dp_rest`` with gradient divide factor dp);
:func:`reduce_expert_grads` is the same reduction for a hand-written loop.

With tensor parallelism the MoE layer is left unsharded (see
``llmforge.parallel.tensor``): tp ranks hold the same tokens (with sequence
parallelism the layer gathers the sequence first) and route them identically.
The ep mesh spans data-parallel ranks only, never tp or pp ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from llmforge.models.moe import MOE_METRIC_KEYS, Counts, GroupedExperts, expert_mlp, metrics_from_sums, moe_metric_sums
from llmforge.parallel.dtensor import local

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


class ExpertParallelExperts(GroupedExperts):
    """GroupedExperts whose weights are sharded over ``ep_mesh`` (set by apply_ep)."""

    ep_mesh: DeviceMesh

    def forward(self, x: torch.Tensor, counts: Counts) -> torch.Tensor:
        ep = self.ep_mesh.size()
        per_rank = self.num_experts // ep
        group = self.ep_mesh.get_group()
        if isinstance(counts, torch.Tensor):
            received = _exchange_counts(counts.view(ep, per_rank), group=group).tolist()  # [src][local expert]
            send_splits = counts.view(ep, per_rank).sum(1).tolist()
        else:  # balanced routing: every rank sends each expert the same count
            mine = self.ep_mesh.get_local_rank()
            received = [list(counts[mine * per_rank : (mine + 1) * per_rank]) for _ in range(ep)]
            send_splits = [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
        recv_splits = [sum(row) for row in received]
        x_recv = _wait(all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group))
        order = _source_to_expert_order(received, device=x.device)
        weights = {name: local(getattr(self, name)) for name in EXPERT_WEIGHTS}
        y_sorted = expert_mlp(x_recv[order], [sum(column) for column in zip(*received, strict=False)], **weights)
        y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
        return _wait(all_to_all_single_autograd(y.contiguous(), send_splits, recv_splits, group))


def _wait(t: torch.Tensor) -> torch.Tensor:
    """Materialise a functional collective's result."""
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


def _exchange_counts(counts: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """counts[r, j]: tokens this rank sends to local expert j of rank r ->
    received[s, j]: tokens rank s sends to this rank's local expert j."""
    send = counts.to(torch.int64).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def _source_to_expert_order(received: list[list[int]], *, device: torch.device) -> torch.Tensor:
    """Indices that regroup tokens laid out by (source rank, local expert) into
    (local expert, source rank) order; ``received[s][j]``: tokens from rank s for local expert j."""
    ep, per_rank = len(received), len(received[0])
    flat = [n for row in received for n in row]
    starts = [sum(flat[:i]) for i in range(len(flat))]
    chunks = [
        torch.arange(starts[s * per_rank + j], starts[s * per_rank + j] + flat[s * per_rank + j])
        for j in range(per_rank)
        for s in range(ep)
    ]
    return torch.cat(chunks).to(device) if chunks else torch.zeros(0, dtype=torch.int64, device=device)


def apply_ep(model: nn.Module, *, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every MoE layer's experts over the one-dimensional ``ep_mesh``, in place."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep needs a one-dimensional ep mesh, got {ep_mesh.ndim} dimensions")
    ep = ep_mesh.size()
    for module in list(model.modules()):
        if not isinstance(module, GroupedExperts) or isinstance(module, ExpertParallelExperts):
            continue
        if module.num_experts % ep:
            raise ValueError(f"{module.num_experts} experts cannot be split over ep={ep} ranks")
        for name in EXPERT_WEIGHTS:
            param = getattr(module, name)
            if param is not None:
                sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
                setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__class__ = ExpertParallelExperts
        module.ep_mesh = ep_mesh
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sharded expert weights apply_ep created (reduced over expert replicas only)."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelExperts) for n in EXPERT_WEIGHTS if (p := getattr(m, n)) is not None]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, *, replica_group: dist.ProcessGroup | None, dp_size: int) -> None:
    """Sum expert gradients over the ranks holding the same experts and divide by the
    whole data-parallel size, so they equal the gradient of the dp-averaged loss.
    ``replica_group`` None means there is one replica (dp·cp == ep)."""
    for param in expert_parameters(model):
        if param.grad is None:
            continue
        grad = local(param.grad)
        if replica_group is not None and dist.get_world_size(replica_group) > 1:
            dist.all_reduce(grad, group=replica_group)
        grad.div_(dp_size)


def load_reducer(mesh) -> Callable[[torch.Tensor], None]:
    """Sums a tensor of per-expert token counts in place over the ranks that route other
    tokens through the same MoE layers (the dp x cp group of this pipeline stage and tp
    coordinate; tp ranks route the same tokens)."""
    group = mesh.dp_cp.get_group()
    return lambda counts: dist.all_reduce(counts, group=group)


def global_moe_metrics(model_parts: list[nn.Module]) -> dict[str, float]:
    """MoE statistics averaged over every MoE layer on every rank (each pipeline
    stage holds different layers, each data-parallel rank routes different tokens).
    A collective: every rank must call it at the same step."""
    sums, count, worst = moe_metric_sums(model_parts)
    device = next(p.device for part in model_parts for p in part.parameters())
    totals = torch.tensor([*(sums[k] for k in MOE_METRIC_KEYS), float(count)], dtype=torch.float64, device=device)
    peak = torch.tensor([worst], dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    values = dict(zip(MOE_METRIC_KEYS, totals[:-1].tolist(), strict=False))
    return metrics_from_sums(values, count=int(totals[-1].item()), worst=float(peak.item()))
