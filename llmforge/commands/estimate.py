"""``llmforge estimate``: the estimate of a plan, or the layout search, as JSON or tables.

Only ``--measure`` (``llmforge.train.measure``) and ``--rehearse`` (``llmforge.rehearse``)
import torch, and only when asked.
"""

from __future__ import annotations

import json
import sys

from llmforge.commands.plans import check_fp8_pays, plan_documents
from llmforge.config.choices import AttentionMask
from llmforge.estimate.attention import attention_cost
from llmforge.estimate.core import estimate_plan
from llmforge.estimate.report import as_dict, search_dict
from llmforge.estimate.search import search_plan, why


def run_estimate(
    plan, *, as_json: bool, timeline: bool, measure: bool, search: bool, top: int, console, rehearse: bool = False, force: bool = False
) -> None:
    """The ``llmforge estimate`` command: print the estimate (or the layout search) of ``plan``
    (an FP8 plan that does not pay is refused unless ``force``)."""
    if search:
        run_search(plan, as_json=as_json, top=top, console=console)
        return
    documents = plan_documents(plan)  # the only files an estimate depends on, read once
    est = estimate_plan(plan, documents=documents)
    verdict = check_fp8_pays(plan, est, force=force)
    data = as_dict(est, recipe=plan.config.recipe)
    if verdict is not None:
        data["fp8"] = verdict.as_dict()
    cost = attention_cost(plan.config, documents=documents)
    data["attention"].update(mask=cost.mask, sliding_window=cost.sliding_window, windowed_layers=cost.windowed_layers, note=cost.note)
    measured = None
    if measure:
        from llmforge.train.measure import measure_plan

        measured = measure_plan(plan, est)
        data["measured"] = measured.as_dict()
    rehearsal = None
    if rehearse:
        from llmforge.commands.rehearsal import rehearsal_dict, rehearse_estimate

        rehearsal = rehearse_estimate(plan, est)
        data["rehearsal"] = rehearsal_dict(rehearsal, est)
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    from llmforge.commands.estimate_tables import render_estimate, render_measured, render_timeline

    render_estimate(est, recipe=plan.config.recipe, console=console)
    for line in verdict.lines() if verdict is not None else ():
        console.print(line, markup=False, highlight=False)
    if cost.fraction < 1.0 or cost.mask != AttentionMask.CAUSAL:
        share = data["attention"]
        console.print(
            f"Attention: {cost.fraction:.3f} of causal attention's work ({cost.note}); "
            f"{share['flops_share']:.1%} of the step's FLOPs, {share['time_share']:.1%} of its time.",
            markup=False,
            highlight=False,
        )
    if timeline:
        render_timeline(est, console=console)
    if measured is not None:
        render_measured(measured, console=console)
    if rehearsal is not None:
        from llmforge.commands.rehearsal import render_rehearsal

        render_rehearsal(rehearsal, est, console=console)


def run_search(plan, *, as_json: bool, top: int, console) -> None:
    """``llmforge estimate --search``: print the ranked layouts (or why nothing fits)."""
    from llmforge.commands.estimate_tables import render_search

    result = search_plan(plan, top=top, documents=plan_documents(plan))
    if as_json:
        sys.stdout.write(json.dumps(search_dict(result, plan=plan), indent=2) + "\n")
        return
    render_search(result, plan=plan, why_text=why(result.ranked[0], result.ranked[1]) if len(result.ranked) > 1 else "", console=console)
