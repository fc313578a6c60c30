"""The step runner of a rank: a gradient-accumulation loop (one process, data,
tensor, context and expert parallelism) or a pipeline schedule, with the
gradient reductions and tied-embedding sync that run after its backward."""

from __future__ import annotations

import functools

import torch
from torch import nn

from llmforge.layout import chunk_rank
from llmforge.models.masks import model_documents, needs_eos
from llmforge.parallel.context import cp_positions
from llmforge.parallel.data import FIRST_BUCKET_BYTES, BucketedGradReduce, GradAllReduce, deferred_reduce, fsdp_sync, grad_sync
from llmforge.parallel.expert import expert_parameters
from llmforge.parallel.mesh import ParallelMesh
from llmforge.parallel.offload import OffloadedStep
from llmforge.parallel.pipeline import StageShapes, build_schedule
from llmforge.parallel.tensor import align_grads, loss_context, sharded_cross_entropy
from llmforge.parallel.tied import TiedEmbeddingSync, tied_group
from llmforge.plan import RunPlan
from llmforge.train.loss import compiled_cross_entropy
from llmforge.train.parallelize import reduces_over_dp
from llmforge.train.pipeline_step import PipelineStep, autocast_forward
from llmforge.train.precision import DTYPES, LossScaler, residual_dtype
from llmforge.train.step import GradAccumulationStep, StepRunner, cross_entropy


def build_step(
    plan: RunPlan,
    *,
    mesh: ParallelMesh | None,
    parts: list[nn.Module],
    ids: list[int],
    tied: list[nn.Parameter],
    scaler: LossScaler,
    device: torch.device,
    eos_id: int | None = None,
) -> StepRunner:
    """The step seam for this rank's layout (``mesh`` None in one process); ``tied``:
    this rank's copies of a tied embedding that pipeline stages keep equal; ``eos_id``:
    the data's end-of-document token (document masks and positions)."""
    documents_of = documents_function(plan, eos_id=eos_id)
    reducers = _zero0_reducers(plan, mesh=mesh, parts=parts, overlap=plan.layout.pp == 1 and plan.overlap_grad_reduce)
    finish = _finish_hooks(plan, mesh=mesh, parts=parts, tied=tied, reducers=reducers)
    if plan.layout.pp == 1:
        step = _accumulation_step(plan, mesh=mesh, model=parts[0], scaler=scaler, device=device, finish=finish, reducers=reducers)
    else:
        step = _pipeline_step(plan, mesh=mesh, parts=parts, ids=ids, scaler=scaler, device=device, finish=finish)
    step.documents_of = documents_of
    if plan.layout.offload_activations:
        return OffloadedStep(step, device=device)
    return step


def loss_function(plan: RunPlan):
    """The loss this plan's last stage runs: ``loss_parallel``'s on vocabulary-sharded logits under
    tensor parallelism, else the fused cross-entropy, compiled under ``train.compile``."""
    if plan.layout.tp > 1:
        return sharded_cross_entropy
    return compiled_cross_entropy if plan.config.train.compile else cross_entropy


def documents_function(plan: RunPlan, *, eos_id: int | None):
    """What computes the model's ``documents`` from a microbatch's inputs (None under plain causal attention)."""
    model = plan.config.model
    if not needs_eos(model) and model.sliding_window == 0:
        return None
    if needs_eos(model) and eos_id is None:
        raise ValueError("the data has no end-of-document token for model.attention_mask=document / model.position_reset")
    return functools.partial(model_documents, model, eos_id=eos_id)


def _bucket_bytes(plan: RunPlan) -> tuple[int, int]:
    """Bucket caps: ``parallel.bucket_mb`` and a first bucket of at most 1 MB."""
    cap = max(1, int(plan.layout.bucket_mb * 2**20))
    return cap, min(cap, FIRST_BUCKET_BYTES)


def _zero0_reducers(plan: RunPlan, *, mesh: ParallelMesh | None, parts: list[nn.Module], overlap: bool) -> list:
    """ZeRO 0 gradient reductions over dp x cp (expert weights over their replicas
    only, divided by dp): bucketed and overlapped with backward when ``overlap``,
    else one flat all-reduce each after backward."""
    if not reduces_over_dp(plan, mesh=mesh) or plan.layout.zero != 0:
        return []
    dtype = DTYPES[plan.config.precision.reduce_dtype]
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    experts = {id(p) for part in parts for p in expert_parameters(part)}
    groups = [([p for p in params if id(p) not in experts], mesh.dp_cp.get_group(), plan.dp * plan.layout.cp)]
    if experts:
        groups.append(([p for p in params if id(p) in experts], mesh.dp_rest.get_group(), plan.dp))
    if not overlap:
        return [GradAllReduce(params=ps, group=g, size=n, dtype=dtype) for ps, g, n in groups]
    cap, first = _bucket_bytes(plan)
    return [BucketedGradReduce(params=ps, group=g, size=n, dtype=dtype, bucket_bytes=cap, first_bucket_bytes=first) for ps, g, n in groups]


def _finish_hooks(plan: RunPlan, *, mesh: ParallelMesh | None, parts: list[nn.Module], tied: list[nn.Parameter], reducers: list):
    """What runs after a step's backward: the ZeRO-0 gradient reductions (the
    bucketed ones before the tensor-parallel gradient layout is fixed, which is the
    same sum as after it: both are linear) or the wait for FSDP2's deferred
    reduce-scatters (ZeRO 1 on gloo), then the tied-embedding sync."""
    hooks = [r for r in reducers if isinstance(r, BucketedGradReduce)]
    hooks.extend(d.wait for d in (deferred_reduce(part) for part in parts) if d is not None)
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    if plan.layout.tp > 1:
        hooks.append(lambda: align_grads(params))
    hooks.extend(r for r in reducers if isinstance(r, GradAllReduce))
    if plan.layout.pp > 1 and plan.config.model.tie_embeddings:
        last_rank = chunk_rank(len(plan.layers_per_stage) - 1, pp=plan.layout.pp, v_shape=plan.layout.v_shape)
        group = tied_group(mesh, first_pp=0, last_pp=last_rank)
        hooks.append(TiedEmbeddingSync(params=tied, group=group))

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


def _accumulation_step(
    plan: RunPlan, *, mesh: ParallelMesh | None, model: nn.Module, scaler, device: torch.device, finish, reducers: list | None = None
) -> GradAccumulationStep:
    cfg = plan.config
    no_sync = None
    if reduces_over_dp(plan, mesh=mesh) and plan.layout.zero > 0:
        no_sync = lambda last: fsdp_sync(model, zero=plan.layout.zero, last=last)  # noqa: E731
    bucketed = [r for r in reducers or [] if isinstance(r, BucketedGradReduce)]
    if bucketed:
        no_sync = lambda last: grad_sync(bucketed, sync=last)  # noqa: E731
    positions = None
    if plan.layout.cp > 1:
        positions = cp_positions(seq_len=cfg.model.seq_len, cp_rank=mesh.local_rank("cp"), cp=plan.layout.cp, device=device)
    return GradAccumulationStep(
        model=model,
        micro_batch_size=plan.layout.micro_batch_size,
        param_dtype=cfg.precision.param_dtype,
        scaler=scaler,
        device=device,
        loss_fn=loss_function(plan),
        no_sync=no_sync,
        reduce_loss=_dp_mean(mesh, plan.dp * plan.layout.cp) if reduces_over_dp(plan, mesh=mesh) else None,
        loss_context=lambda: loss_context(plan.layout.tp),
        finish=finish,
        positions=positions,
    )


def _pipeline_step(
    plan: RunPlan, *, mesh: ParallelMesh, parts: list[nn.Module], ids: list[int], scaler, device: torch.device, finish
) -> PipelineStep:
    cfg = plan.config
    num_stages = len(plan.layers_per_stage)
    for part in parts:
        autocast_forward(part, param_dtype=cfg.precision.param_dtype, device=device)
    step = PipelineStep(
        schedule=None,
        has_first=0 in ids,
        has_last=num_stages - 1 in ids,
        loss_fn=loss_function(plan),
        scaler=scaler,
        device=device,
        pp_group=mesh.pp.get_group(),
        dp_group=mesh.dp.get_group(),
        dp_size=plan.dp,
        context=lambda: loss_context(plan.layout.tp),
        finish=finish,
        modules=list(parts),
    )
    step.schedule = build_schedule(
        name=plan.layout.pp_schedule,
        modules=parts,
        ids=ids,
        num_stages=num_stages,
        group=mesh.pp.get_group(),
        device=device,
        microbatches=plan.microbatches,
        loss_fn=step.scaled_loss,
        shapes=stage_shapes(plan),
    )
    return step


def stage_shapes(plan: RunPlan) -> StageShapes:
    """What a microbatch carries between this plan's pipeline chunks (the residual stream's dtype:
    ``llmforge.parallel.residual``)."""
    m, p, lay = plan.config.model, plan.config.precision, plan.layout
    return StageShapes(
        micro_batch=plan.layout.micro_batch_size,
        seq_len=m.seq_len,
        stream_tokens=m.seq_len // lay.tp if plan.layout.sequence_parallel else m.seq_len,
        hidden=m.hidden_size,
        stream_dtype=residual_dtype(param_dtype=p.param_dtype, fp32_residual=p.fp32_residual),
        logits=m.vocab_size // lay.tp,
        logits_dtype=DTYPES[p.param_dtype],
    )
