"""What ``llmforge estimate`` prints: a Rich breakdown, a JSON object, a short summary.

The JSON schema (``--json``, one object, memory in bytes for the most-loaded
device) is documented in docs/estimator.md; ``as_dict`` builds it.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict

from llmforge.estimate.core import Estimate, estimate_plan
from llmforge.hardware import GIB

SCHEMA = "llmforge.estimate/1"


def gib(n: float) -> str:
    """Bytes as GiB text."""
    return f"{n / GIB:,.2f} GiB"


def verdict(est: Estimate) -> str:
    """'fits, 12.3 GiB headroom (15%)' or 'does not fit: 4.1 GiB over 80 GiB'."""
    cap = est.job.profile.memory_bytes
    if est.fits:
        return f"fits, {gib(est.headroom)} headroom ({est.headroom / cap:.0%} of {gib(cap)})"
    return f"does not fit: {gib(-est.headroom)} over the {gib(cap)} of a {est.job.profile.name}"


def where(est: Estimate) -> str:
    """Which rank is the most loaded, in words."""
    lay = est.layout
    parts = [f"pipeline stage {est.worst.stage}"] if lay.pp > 1 else []
    parts += [f"{n} rank 0" for n, v in (("tp", lay.tp), ("ep", lay.ep), ("dp", lay.dp)) if v > 1]
    return ", ".join(parts) or "the only device"


def as_dict(est: Estimate, *, recipe: str = "") -> Dict[str, Any]:
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
            "weights": w.weights, "grads": w.grads, "optimizer": w.optimizer, "activations": w.activations,
            "transient": w.transient, "reserved": w.reserved, "total": w.total,
        },
        "most_loaded": {"pipeline_stage": w.stage, "description": where(est)},
        "device_memory_bytes": est.job.profile.memory_bytes,
        "fits": est.fits,
        "headroom_bytes": est.headroom,
        "stages": [{"stage": s.stage, "params": s.params, "total_bytes": s.total, "activations_bytes": s.activations} for s in est.stages],
        "pipeline": {
            "schedule": lay.schedule if lay.pp > 1 else "none", "stages": lay.pp, "virtual_stages": lay.virtual_stages,
            "microbatches": est.microbatches, "bubble_fraction": est.bubble,
        },
        "flops": {
            "model_per_step": est.model_flops, "hardware_per_step": est.hardware_flops,
            "convention": "matmul FLOPs, 2 per multiply-add; attention scores counted in full (no causal halving)",
        },
        "communication_bytes": {"dp": c.dp_bytes, "tp": c.tp_bytes, "pp": c.pp_bytes, "cp": c.cp_bytes, "ep": c.ep_bytes},
        "communication_s": {"dp": c.dp_s, "tp": c.tp_s, "pp": c.pp_s, "cp": c.cp_s, "ep": c.ep_s},
        "time": {
            "step_s": est.step_s, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
            "efficiency": est.job.efficiency, "breakdown_s": dict(est.parts),
        },
    }


def short_summary(plan) -> tuple[str, bool]:
    """One paragraph for ``pretrain`` before launch, and whether the plan fits."""
    est = estimate_plan(plan)
    text = (
        f"Estimate on {est.layout.world} x {est.job.profile.name}: {est.params_total / 1e9:.3g}B parameters, "
        f"{gib(est.worst.total)} on the most-loaded device ({where(est)}) -> {verdict(est)}. "
        f"Step ~{_duration(est.step_s)}, {est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.0%}"
        + (f", pipeline bubble {est.bubble:.1%}" if est.layout.pp > 1 else "") + "."
    )
    return text, est.fits


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def run_estimate(plan, *, as_json: bool, timeline: bool, measure: bool, search: bool, top: int, console) -> None:
    """The ``llmforge estimate`` command: print the estimate (or the layout search) of ``plan``."""
    if search:
        from llmforge.estimate.search import run_search

        run_search(plan, as_json=as_json, top=top, console=console)
        return
    est = estimate_plan(plan)
    data = as_dict(est, recipe=plan.config.recipe)
    measured = None
    if measure:
        from llmforge.estimate.measure import measure_plan

        measured = measure_plan(plan, est)
        data["measured"] = measured.as_dict()
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    from llmforge.estimate.render import render_estimate, render_measured, render_timeline

    render_estimate(est, recipe=plan.config.recipe, console=console)
    if timeline:
        render_timeline(est, console=console)
    if measured is not None:
        render_measured(measured, console=console)
