"""What ``llmforge estimate`` reports: the JSON objects and the short summary.

The JSON schema (``--json``, one object, memory in bytes for the most-loaded
device) is documented in docs/estimator.md; ``as_dict`` builds it, ``search_dict``
the ``--search --json`` one. The Rich tables are ``llmforge.commands.estimate_tables``.
"""

from __future__ import annotations

from typing import Any

from llmforge.config.choices import Recompute
from llmforge.errors import Problem
from llmforge.estimate import kernels as kn
from llmforge.estimate.core import Estimate, estimate_plan
from llmforge.estimate.node import fix
from llmforge.estimate.params import stage_counts
from llmforge.estimate.search import SearchResult, why
from llmforge.estimate.text import duration, gib, verdict, where
from llmforge.plan import RunPlan

SCHEMA = "llmforge.estimate/1"
DIMS = ("dp", "tp", "pp", "cp", "ep")


def as_dict(est: Estimate, *, recipe: str = "") -> dict[str, Any]:
    """The documented JSON object of one estimate."""
    w, lay, c = est.worst, est.layout, est.comm
    return {
        "schema": SCHEMA,
        "recipe": recipe,
        "accelerator": est.job.profile.name,
        "world_size": lay.world,
        "layout": lay.overrides(),
        "params": {"total": est.params_total, "active": est.params_active, "per_device": w.params},
        "memory_bytes": {
            "weights": w.weights,
            "grads": w.grads,
            "optimizer": w.optimizer,
            "activations": w.activations,
            "transient": w.transient,
            "reserved": w.reserved,
            "total": w.total,
        },
        "most_loaded": {"pipeline_stage": w.stage, "description": where(est), "peak": w.peak},
        "device_memory_bytes": est.job.profile.memory_bytes,
        "fits": est.fits,
        "headroom_bytes": est.headroom,
        "stages": [{"stage": s.stage, "params": s.params, "total_bytes": s.total, "activations_bytes": s.activations} for s in est.stages],
        "pipeline": {
            "schedule": lay.pp_schedule if lay.pp > 1 else "none",
            "stages": lay.pp,
            "virtual_stages": lay.pp_virtual_stages,
            "microbatches": est.microbatches,
            "bubble_fraction": est.bubble,
        },
        "flops": {
            "model_per_step": est.model_flops,
            "hardware_per_step": est.hardware_flops,
            "convention": "matmul FLOPs, 2 per multiply-add; attention scores counted in full (no causal halving)",
        },
        "communication_bytes": {d: c.bytes_of(d) for d in DIMS},
        "communication_s": {d: c.seconds_of(d) for d in DIMS},
        "communication": {
            kind: {"bytes": t.bytes, "seconds": t.seconds, "exposed_s": t.exposed, "hidden_s": t.hidden} for kind, t in c.kinds.items()
        },
        "host": None
        if est.host is None
        else {
            "states_bytes": est.host.states_bytes,
            "activations_bytes": est.host.activations_bytes,
            "node_bytes": est.host.node_bytes,
            "node_capacity_bytes": est.host.node_capacity,
            "copy_s": est.host.copy_s,
            "exposed_copy_s": est.host.exposed_copy_s,
            "cpu_optimizer_s": est.host.optimizer_s,
        },
        "node": None
        if est.node is None
        else {
            "ranks": est.node.ranks,
            "host_bytes": est.node.total,
            "host_capacity_bytes": est.node.capacity,
            "per_rank_bytes": est.node.per_rank,
            "per_rank_items": dict(est.node.items),
            "fits": est.node.fits,
        },
        "attention": step_share(est),
        "time": {
            "step_s": est.step_s,
            "tokens_per_s": est.tokens_per_s,
            "mfu": est.mfu,
            "efficiency": est.job.efficiency,
            "compile": est.job.compile,
            "breakdown_s": dict(est.parts),
            "terms_s": est.terms,
        },
    }


def step_share(est: Estimate) -> dict[str, float]:
    """The attention core's share of an estimate's step: of the hardware FLOPs (every device,
    forward, backward and recomputation) and of the step time (the most-loaded pipeline rank)."""
    shape, layout, job = est.shape, est.layout, est.job
    tokens = job.global_batch * shape.seq
    per_layer = 4 * shape.attention_span * shape.hidden  # forward, per token
    full = layout.recompute == Recompute.FULL
    counts = stage_counts(shape, layout)
    recomputed = sum(c.dense_ckpt + c.moe_ckpt for c in counts) if full else 0
    flops = tokens * per_layer * (3.5 * shape.num_layers + recomputed)
    local = layout.micro_batch_size * shape.seq / layout.cp * per_layer / layout.tp  # one block, one microbatch
    sp = kn.speeds(job)
    block_s = (
        sp.attention(local, 1, head_dim=shape.head_dim).seconds
        + sp.attention(2.5 * local, 3, head_dim=shape.head_dim, backward=True).seconds
    )
    worst = max(counts, key=lambda c: c.blocks)
    again = (worst.dense_ckpt + worst.moe_ckpt) * sp.attention(local, 1, head_dim=shape.head_dim).seconds if full else 0.0
    seconds = est.microbatches * (worst.blocks * block_s + again)
    return {
        "fraction_of_causal": shape.attention_fraction,
        "flops_share": flops / est.hardware_flops,
        "time_share": seconds / est.step_s if est.step_s > 0 else 0.0,
    }


def short_summary(plan: RunPlan) -> tuple[str, bool]:
    """One paragraph for ``pretrain`` before launch, and whether the plan fits."""
    est = estimate_plan(plan)
    return summary_text(est), est.fits


def summary_text(est: Estimate) -> str:
    """The paragraph ``pretrain`` shows before launch."""
    return (
        f"Estimate on {est.layout.world} x {est.job.profile.name}: {est.params_total / 1e9:.3g}B parameters, "
        f"{gib(est.worst.total)} on the most-loaded device ({where(est)}) -> {verdict(est)}. "
        f"Step ~{duration(est.step_s)}, {est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.0%}"
        + (f", pipeline bubble {est.bubble:.1%}" if est.layout.pp > 1 else "")
        + "."
    )


def fit_problems(est: Estimate) -> list[Problem]:
    """Why a plan does not fit, each with its fix: the device, the offloaded states, the node."""
    out: list[Problem] = []
    overrides = est.layout.overrides()
    if not est.fits_device:
        out.append(
            Problem(
                "cluster.accelerator",
                est.job.profile.name,
                f"the most-loaded device ({where(est)}) needs {gib(est.worst.total)}, "
                f"{gib(-est.headroom)} over its {gib(est.job.profile.memory_bytes)}",
                "change the layout (llmforge estimate --search lists the ones that fit), or pass --force",
            )
        )
    if est.host is not None and not est.host.fits:
        out.append(
            Problem(
                "parallel.offload",
                est.layout.offload,
                verdict(est).removeprefix("does not fit: "),
                "shard over more ranks (parallel.dp, parallel.zero=3), offload less, or pass --force",
            )
        )
    node = est.node
    if node is not None and not node.fits:
        items = ", ".join(f"{name} {gib(value)}" for name, value in node.items.items())
        capacity = "this machine" if est.job.host_memory is not None else "the profile's host_memory_gib"
        out.append(
            Problem(
                "cluster.devices_per_node",
                node.ranks,
                f"the {node.ranks} ranks of a node need {gib(node.total)} of host memory together "
                f"({node.ranks} x {gib(node.per_rank)}: {items}), "
                f"{gib(node.total - node.capacity)} over the node's {gib(node.capacity)} ({capacity}); layout {overrides}",
                fix(node, est.layout),
            )
        )
    return out


def search_dict(result: SearchResult, *, plan: RunPlan) -> dict[str, Any]:
    """The ``--search --json`` object."""
    top = [{"rank": i + 1, "overrides": e.layout.overrides(), **as_dict(e, recipe=plan.config.recipe)} for i, e in enumerate(result.ranked)]
    return {
        "schema": "llmforge.search/1",
        "recipe": plan.config.recipe,
        "world_size": result.world,
        "accelerator": plan.config.cluster.accelerator,
        "evaluated": result.evaluated,
        "fitting": result.fitting,
        "seconds": result.seconds,
        "layouts_per_s": result.rate,
        "nothing_fits": not result.ranked,
        "top": top,
        "why": why(result.ranked[0], result.ranked[1]) if len(result.ranked) > 1 else "",
        "suggestions": result.suggestions,
        "offloaded": result.offloaded,
    }
