"""Apply every parallelism to a model (or pipeline chunk) in the documented order.

Order (as in torchtitan): float8 or QAT fake quantization -> tensor parallel -> expert parallel -> context
parallel -> the residual stream's dtype (16-bit compute) -> activation recompute ->
compile (with async TP's Inductor pass when ``parallel.async_tp``) -> FSDP (over dp x cp).
The model (or its pipeline chunks) arrives on the meta
device and is sharded there; the builder (``llmforge.train.build``) then allocates only
this rank's shards and cuts each one from the parameter's whole seeded value, so every
layout starts from the same numbers. A single process goes through the same function
with every degree 1 (no mesh).
"""

from __future__ import annotations

from torch import nn

from llmforge.blockspec.fp8 import fp8_choice_of
from llmforge.config.choices import Dtype, Fp8Recipe, Offload, Qat, Recompute
from llmforge.parallel.compile import apply_async_tp, apply_compile
from llmforge.parallel.context import apply_cp
from llmforge.parallel.data import apply_fsdp, can_defer_reduce
from llmforge.parallel.expert import apply_ep
from llmforge.parallel.float8 import apply_float8
from llmforge.parallel.mesh import ParallelMesh
from llmforge.parallel.qat import apply_qat
from llmforge.parallel.recompute import apply_recompute
from llmforge.parallel.residual import apply_residual_dtype
from llmforge.parallel.tensor import apply_tp
from llmforge.plan import RunPlan
from llmforge.train.precision import DTYPES, residual_dtype


def parallelize(model: nn.Module, *, plan: RunPlan, mesh: ParallelMesh | None) -> None:
    """Shard one model (or pipeline chunk) in place: float8 or QAT -> TP -> EP -> CP -> residual dtype -> recompute -> compile -> FSDP.
    ``mesh`` may be None in one process, where only float8 or QAT, the residual dtype, recompute and compile apply."""
    p = plan.layout
    if plan.config.precision.fp8:
        apply_float8(
            model,
            recipe=plan.config.precision.fp8_recipe,
            emulate=plan.config.precision.fp8_emulate,
            fsdp_all_gather=fp8_all_gather(plan, mesh=mesh),
            choice=fp8_choice_of(plan.config),
        )
    if plan.config.precision.qat != Qat.NONE:
        apply_qat(model, scheme=plan.config.precision.qat, group_size=plan.config.precision.qat_group_size)
    if plan.layout.tp > 1:
        apply_tp(model, tp_mesh=mesh.tp, sequence_parallel=p.sequence_parallel, async_tp=p.async_tp)
    if plan.layout.ep > 1:
        apply_ep(model, ep_mesh=mesh.ep)
    if plan.layout.cp > 1:
        apply_cp(model, cp_mesh=mesh.cp)
    precision = plan.config.precision
    if precision.param_dtype != Dtype.FP32:
        apply_residual_dtype(model, dtype=residual_dtype(param_dtype=precision.param_dtype, fp32_residual=precision.fp32_residual))
    if p.recompute != Recompute.NONE:
        apply_recompute(model, mode=p.recompute, every=p.recompute_every, compiled=plan.config.train.compile)
    if plan.config.train.compile:
        if p.async_tp:  # refused by the plan without compile, CUDA, tp > 1 and sequence parallel
            apply_async_tp(mesh.tp)
        apply_compile(model)
    if uses_fsdp(plan, mesh=mesh):
        experts = mesh.dp_rest if plan.layout.ep > 1 else None
        defer = (
            plan.overlap_grad_reduce
            and plan.layout.pp == 1
            and can_defer_reduce(
                device_type=mesh.fsdp.device_type,
                zero=p.zero,
                reduce_dtype=DTYPES[precision.reduce_dtype],
                offload=p.offload == Offload.STATES,
                replicated=p.dp_replicate > 1,
                experts=experts is not None,
            )
        )
        apply_fsdp(
            model,
            dp_mesh=mesh.fsdp,
            zero=p.zero,
            param_dtype=DTYPES[precision.param_dtype],
            reduce_dtype=DTYPES[precision.reduce_dtype],
            expert_mesh=experts,
            offload=p.offload == Offload.STATES,
            fp32_residual=precision.fp32_residual,
            defer=defer,
            release_reduce_input=plan.config.cluster.accelerator == "cpu",
        )
    elif p.offload == Offload.STATES:
        raise RuntimeError(
            "parallel.offload=states needs FSDP2 on a process group: a one-rank plan goes through torchrun (llmforge.launch.run.runs_here)"
        )


def uses_fsdp(plan: RunPlan, *, mesh: ParallelMesh | None) -> bool:
    """ZeRO 1-3 on a distributed rank that reduces over its data-parallel group: FSDP2 shards the model."""
    return plan.layout.zero > 0 and reduces_over_dp(plan, mesh=mesh)


def fp8_all_gather(plan: RunPlan, *, mesh: ParallelMesh | None) -> bool:
    """Float8 all-gather of FSDP-sharded weights: tensorwise fp8 under FSDP, unless turned off."""
    precision = plan.config.precision
    return precision.fp8 and precision.fp8_recipe == Fp8Recipe.TENSORWISE and precision.fp8_all_gather and uses_fsdp(plan, mesh=mesh)


def reduces_over_dp(plan: RunPlan, *, mesh: ParallelMesh | None) -> bool:
    """Whether a distributed rank (``mesh`` set) shards (ZeRO) and reduces gradients and the loss
    over its data-parallel group: when dp x cp > 1, and also for a one-rank plan
    started through torchrun (``cluster.launcher=torchrun``), whose groups of one
    take the multi-GPU code path (FSDP2, bucketed all-reduce) so one GPU checks it."""
    return mesh is not None and (plan.dp * plan.layout.cp > 1 or plan.world_size == 1)
