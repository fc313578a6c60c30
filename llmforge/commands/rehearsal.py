"""``llmforge estimate --rehearse`` and the rehearsal ``pretrain`` runs before launch
(``train.rehearse``): the most-loaded rank's program on fake tensors, next to the estimate."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from llmforge.config.choices import Rehearse
from llmforge.estimate.core import Estimate
from llmforge.estimate.inventory import inventory
from llmforge.estimate.memory import stage_activations
from llmforge.estimate.text import gib, where
from llmforge.plan import RunPlan

ITEMS = ("weights", "grads", "optimizer", "activations", "transient")
#: ``train.rehearse=auto`` rehearses plans of at least this many parameters on accelerators.
AUTO_MIN_PARAMS = 1e9


def whole_compute_copy(est: Estimate) -> bool:
    """Whether the estimate keeps a whole compute copy of the weights (ZeRO 1-2, pipelines)
    rather than gathered blocks (ZeRO 3): where the rehearsal's gathered copies go."""
    lay = est.layout
    return lay.dp * lay.cp > 1 and lay.zero > 0 and (lay.zero < 3 or lay.pp > 1)


def rehearse_estimate(plan: RunPlan, est: Estimate):
    """Rehearse the estimate's most-loaded rank (torch imported here only)."""
    from llmforge.errors import Problem, UserError
    from llmforge.rehearse.run import rehearse, unsupported

    reason = unsupported(plan)
    if reason:
        raise UserError(
            [Problem("--rehearse", str(plan.layout), reason, "rehearse a layout without it, or leave out --rehearse")],
            title="cannot rehearse this plan",
        )
    return rehearse(plan, stage=est.worst.stage, where=where(est))


def activations_in_flight(est: Estimate) -> float:
    """The estimate's saved activations of the most-loaded stage with every microbatch its
    schedule holds at once (the step's peak may come when fewer are live)."""
    inv = inventory(est.shape, est.layout)
    return stage_activations(inv, est.job, est.worst.stage, est.microbatches)


def rehearsal_dict(rehearsal, est: Estimate) -> dict:
    """The ``rehearsal`` object of ``estimate --json`` (bytes; docs/estimator.md)."""
    out = rehearsal.as_dict(whole_compute_copy=whole_compute_copy(est))
    estimated = sum(getattr(est.worst, k) for k in ITEMS)
    out["estimate_bytes"] = estimated
    out["estimate_activations_peak_bytes"] = activations_in_flight(est)
    out["ratio"] = rehearsal.step_peak_bytes / estimated if estimated else None
    return out


def render_rehearsal(rehearsal, est: Estimate, *, console: Console) -> None:
    """The rehearsed peak item by item next to the estimate's."""
    items = rehearsal.as_estimate_items(whole_compute_copy=whole_compute_copy(est))
    table = Table(
        title=f"Rehearsal of rank {rehearsal.rank} ({rehearsal.where}): fake tensors, the build and two steps "
        f"(the second shown), {rehearsal.seconds:.0f} s"
    )
    for name in ("", "estimate", "rehearsed", "rehearsed / estimate"):
        table.add_column(name, justify="left" if not name else "right")
    for name in ITEMS:
        e, r = getattr(est.worst, name), items[name]
        table.add_row(name, gib(e), gib(r), f"{r / e:.2f}" if e else "-")
    e_total = sum(getattr(est.worst, k) for k in ITEMS)
    table.add_row(
        "total (tensors)",
        gib(e_total),
        gib(rehearsal.step_peak_bytes),
        f"{rehearsal.step_peak_bytes / e_total:.2f}" if e_total else "-",
        style="bold",
    )
    table.add_row("reserved", gib(est.worst.reserved), "not rehearsed", "")
    e_act, r_act = activations_in_flight(est), rehearsal.activations_peak_bytes
    table.add_row("activations at their own peak", gib(e_act), gib(r_act), f"{r_act / e_act:.2f}" if e_act else "-", style="dim")
    console.print(table)
    console.print(
        f"Build peak: {gib(rehearsal.build_peak_bytes)}"
        + (
            " (above the step's: the build holds more than the rank keeps)"
            if rehearsal.build_peak_bytes > rehearsal.step_peak_bytes
            else ""
        ),
        markup=False,
        highlight=False,
    )
    for note in rehearsal.differences:
        console.print(f"note: {note}", style="dim", markup=False, highlight=False)


#: Rehearsed and estimated totals further apart than this are named before launch.
AGREEMENT = 0.10


def disagreement(items: dict[str, int], estimated: dict[str, float]) -> str:
    """A line naming the item furthest from the estimate when the rehearsed total is more than
    ``AGREEMENT`` from the estimated one ('' when they agree)."""
    total_r, total_e = sum(items.values()), sum(estimated.values())
    if not total_e or abs(total_r / total_e - 1) <= AGREEMENT:
        return ""
    name = max(ITEMS, key=lambda k: abs(items[k] - estimated[k]))
    return (
        f"the rehearsal's tensors ({gib(total_r)}) differ from the estimate's ({gib(total_e)}) by "
        f"{abs(total_r / total_e - 1):.0%}, most in {name}: {gib(items[name])} rehearsed, {gib(estimated[name])} "
        "estimated; the launch check uses the rehearsed peak"
    )


def should_rehearse(plan: RunPlan) -> bool:
    """``train.rehearse``: always, never, or auto (plans of ``AUTO_MIN_PARAMS`` parameters or more
    on accelerators, whose launch a rehearsal on this CPU can save)."""
    choice = plan.config.train.rehearse
    if choice != Rehearse.AUTO:
        return choice == Rehearse.ALWAYS
    from llmforge.estimate.params import total_params
    from llmforge.estimate.shape import shape_from_config

    return plan.config.cluster.accelerator != "cpu" and total_params(shape_from_config(plan.config.model)) >= AUTO_MIN_PARAMS


def rehearse_before_launch(plan: RunPlan, est: Estimate, *, force: bool, console: Console) -> None:
    """``pretrain``'s rehearsal (``train.rehearse``): refuse a plan whose rehearsed peak, with the
    estimate's reserved bytes (``est``: the run's one estimate), does not fit the device, unless forced."""
    if not should_rehearse(plan):
        return
    from llmforge.errors import fail
    from llmforge.rehearse.run import unsupported

    if unsupported(plan):
        console.print(f"note: no rehearsal before launch: {unsupported(plan)}", style="yellow", markup=False, highlight=False)
        return
    rehearsal = rehearse_estimate(plan, est)
    need, have = rehearsal.peak_bytes + est.worst.reserved, est.job.profile.memory_bytes
    items = rehearsal.as_estimate_items(whole_compute_copy=whole_compute_copy(est))
    differs = disagreement(items, {k: getattr(est.worst, k) for k in ITEMS})
    if differs:
        console.print(f"note: {differs}", style="yellow", markup=False, highlight=False)
    console.print(
        f"Rehearsed rank {rehearsal.rank}: peak {gib(rehearsal.peak_bytes)} + reserved {gib(est.worst.reserved)} "
        f"= {gib(need)} of {gib(have)} ({rehearsal.seconds:.0f} s on fake tensors)",
        markup=False,
        highlight=False,
    )
    if need > have and not force:
        raise fail(
            f"the rehearsed rank {rehearsal.rank} needs {gib(need)} of the device's {gib(have)}; change the layout "
            "(llmforge estimate --search), set train.rehearse=false, or pass --force"
        )
