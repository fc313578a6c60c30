"""Rich tables for ``llmforge estimate``: breakdown, timeline, measured comparison."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from llmforge.config.choices import Offload, Optimizer
from llmforge.estimate.allocator import CPU_HEAP_SLACK, FRAGMENTATION
from llmforge.estimate.core import Estimate
from llmforge.estimate.cpu_memory import cpu_step_bytes
from llmforge.estimate.memory import CPU_PROCESS_BYTES
from llmforge.estimate.node import words
from llmforge.estimate.pipeline import simulate, simulated_bubble
from llmforge.estimate.text import gib, verdict, where
from llmforge.layout import ZERO_BUBBLE_SCHEDULES


def _state_notes(est: Estimate) -> tuple[str, str]:
    """How the weights and gradients are kept under the layout's ZeRO stage."""
    lay, c, r = est.layout, est.job.param_dtype, est.job.reduce_dtype
    if lay.offload == Offload.STATES:
        whole = lay.zero < 3 or lay.pp > 1
        return (
            f"whole {c} compute copy (fp32 shard in host memory)" if whole else "gathered block by block (fp32 shard in host memory)",
            f"whole, in {r}, until copied to the host" if lay.zero == 1 or lay.pp > 1 else "one block's, copied to the host",
        )
    made = "" if est.worst.grads else "; made in backward as the activations are freed: none yet at the peak"
    if lay.zero == 0 or lay.dp * lay.cp == 1:
        return "fp32, replicated", "fp32, one per parameter" + made
    whole_grads = lay.zero == 1 or lay.pp > 1
    weights = "fp32 shard" + ("" if lay.zero == 3 and lay.pp == 1 else f" + whole {c} compute copy")
    return weights, (f"whole, in {r} (reduce-scattered once)" if whole_grads else "fp32 shard") + made


#: What the transient buffers are at each moment the step may peak (llmforge.estimate.phases).
_TRANSIENT_WORDS = {
    "": "logits at the loss, recompute working set, gathers, buckets",
    "end of the forward": "autocast's cached weight copies of recomputed blocks; under accumulation the last logits",
    "end of the backward": "recompute working set or the tied embedding's gradient, buckets",
}


def _memory_table(est: Estimate) -> Table:
    w, lay = est.worst, est.layout
    table = Table(title=f"Memory of the most-loaded device: {where(est)}, at the {w.peak}", title_justify="left")
    table.add_column("item")
    table.add_column("bytes", justify="right")
    table.add_column("how it is counted")
    weights, grads = _state_notes(est)
    table.add_row("weights", gib(w.weights), f"{w.params / 1e6:,.1f}M params on this rank; ZeRO-{lay.zero}: {weights}")
    table.add_row("gradients", gib(w.grads), grads)
    if est.job.optimizer == Optimizer.MUON:
        table.add_row(
            "optimizer (Muon)", gib(w.optimizer), "one fp32 momentum per block matrix, two fp32 AdamW moments per other parameter"
        )
    else:
        table.add_row(
            "optimizer (AdamW)",
            gib(w.optimizer),
            "two fp32 moments per parameter" + (", in host memory (stepped on the CPU)" if lay.offload == Offload.STATES else ""),
        )
    table.add_row(
        "activations",
        gib(w.activations),
        f"recompute={lay.recompute}; microbatches in flight per the {lay.pp_schedule if lay.pp > 1 else 'accumulation'} schedule",
    )
    table.add_row("transient buffers", gib(w.transient), _TRANSIENT_WORDS.get(w.peak, _TRANSIENT_WORDS[""]))
    table.add_row("allowance", gib(w.reserved), _allowance_words(est))
    table.add_row(
        Text("total", style="bold"),
        Text(gib(w.total), style="bold"),
        Text(f"of {gib(est.job.profile.memory_bytes)} ({est.job.profile.name})"),
    )
    if est.host is not None:
        h = est.host
        table.add_row(
            "host memory / node",
            gib(h.node_bytes),
            f"offloaded: {gib(h.states_bytes)} model states + {gib(h.activations_bytes)} activations per device, "
            f"of {gib(h.node_capacity)} per node",
        )
    return table


_TERM_NAMES = {
    "matmul": "matmuls",
    "attention": "fused attention",
    "memory_bound": "memory-bound kernels",
    "launch_floor": "kernel launch floor",
    "dp_all_reduce_exposed": "dp all-reduce (exposed)",
    "dp_all_gather_exposed": "dp all-gather (exposed)",
    "dp_reduce_scatter_exposed": "dp reduce-scatter (exposed)",
    "tp_exposed": "tensor-parallel collectives",
    "pp_exposed": "pipeline send/recv (exposed)",
    "cp_exposed": "context-parallel ring (exposed)",
    "ep_exposed": "expert all-to-all",
    "bubble": "pipeline bubble",
    "comm_overlap": "compute slowed by hidden communication",
    "optimizer": "optimizer step and clip",
    "offload_copy": "host-link copies (offload, exposed)",
    "cpu_optimizer": "optimizer step on the CPU (offload)",
    "tp_host": "tensor-parallel host time (DTensor calls, clip collectives)",
    "collective_waits": "waits of the collectives the host blocks on",
    "fsdp_host": "FSDP2's host work (hooks, buffer copies, DTensor optimizer)",
}


def _time_table(est: Estimate) -> Table:
    fused = ", blocks compiled" if est.job.compile else ""
    table = Table(
        title=f"Step time ({'flat efficiency' if est.job.efficiency is not None else 'kernel model'}{fused})", title_justify="left"
    )
    table.add_column("term")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for key, value in est.terms.items():
        if value > 0:
            table.add_row(_TERM_NAMES[key], f"{value:.4g}", f"{value / est.step_s:.1%}")
    table.add_row(Text("step", style="bold"), Text(f"{est.step_s:.4g}", style="bold"), "")
    return table


def _comm_table(est: Estimate) -> Table:
    table = Table(title="Communication per device and step", title_justify="left")
    for name in ("kind", "volume", "seconds", "exposed", "hidden"):
        table.add_column(name, justify="left" if name == "kind" else "right")
    for kind, t in est.comm.kinds.items():
        table.add_row(kind.replace("_", " "), gib(t.bytes), f"{t.seconds:.4g}", f"{t.exposed:.4g}", f"{t.hidden:.4g}")
    return table


def _summary_table(est: Estimate, recipe: str) -> Table:
    lay, c = est.layout, est.comm
    table = Table(
        show_header=False, title=Text(f"llmforge estimate: {recipe} on {lay.world} x {est.job.profile.name}"), title_justify="left"
    )
    table.add_column("key", style="cyan")
    table.add_column("value")
    table.add_row("layout", lay.overrides())
    table.add_row("parameters", f"{est.params_total:,} total, {est.params_active:,} active per token")
    pipe = f"{lay.pp_schedule}, {lay.pp} stages x {lay.pp_virtual_stages} chunks, " if lay.pp > 1 else "no pipeline, "
    table.add_row("pipeline", f"{pipe}{est.microbatches} microbatches, bubble {est.bubble:.2%}")
    table.add_row("FLOPs / step", f"model {est.model_flops:.4g}, hardware {est.hardware_flops:.4g} (causal not halved)")
    vols = ", ".join(f"{k} {gib(c.bytes_of(k))}" for k in ("dp", "tp", "pp", "cp", "ep") if c.bytes_of(k))
    table.add_row("comm. / device / step", vols or "none")
    how = f"efficiency {est.job.efficiency:g} of peak" if est.job.efficiency is not None else f"kernel model of {est.job.profile.name}"
    table.add_row("throughput", f"{est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.1%} ({how})")
    if est.node is not None:
        table.add_row("host memory / node", _node_text(est))
    if est.host is not None:
        h = est.host
        table.add_row(
            "CPU offload",
            f"host-link copies {h.copy_s:.3g} s/step ({h.copy_s - h.exposed_copy_s:.3g} s hidden by compute), "
            f"CPU AdamW {h.optimizer_s:.3g} s (host memory bandwidth {est.job.profile.host_memory_bandwidth / 1e9:g} GB/s per node)",
        )
    return table


def _node_text(est: Estimate) -> str:
    """The node's host memory: its ranks, what each keeps, the capacity and whether it fits."""
    node = est.node
    items = ", ".join(f"{name} {gib(value)}" for name, value in node.items.items())
    where_from = "this machine's memory" if est.job.host_memory is not None else "the profile's host_memory_gib"
    state = "fits" if node.fits else f"does not fit: {gib(node.total - node.capacity)} over"
    return f"{words(node)} ({where_from}); per rank {items}; {state}"


def render_estimate(est: Estimate, *, recipe: str, console) -> None:
    """Summary, memory and step-time tables, then the verdict."""
    console.print(_summary_table(est, recipe))
    console.print(_memory_table(est))
    console.print(_time_table(est))
    if est.comm.kinds:
        console.print(_comm_table(est))
    style = "bold green" if est.fits else "bold red"
    console.print(Text(f"Verdict: {verdict(est)}", style=style))


def _shown_microbatches(est: Estimate) -> int:
    lay, m = est.layout, est.microbatches
    shown = min(m, max(2 * lay.pp, 4))
    if lay.pp_virtual_stages > 1:
        shown = max(lay.pp, shown // lay.pp * lay.pp)
    return shown


def _fitting_slots(est: Estimate, width: int, cell: int):
    """Simulate with as many microbatches as fit the console width (at least enough to fill the pipe)."""
    lay = est.layout
    step = lay.pp if lay.pp_virtual_stages > 1 else 1
    m = _shown_microbatches(est)
    while True:
        slots = simulate(lay, m)
        end = max(s.start + s.length for row in slots.values() for s in row)
        if 8 + end * cell <= width or m - step < max(lay.pp, 1):
            return m, slots, end
        m -= step


def render_timeline(est: Estimate, *, console) -> None:
    """Each pipeline rank's slots: F/B/W with microbatch number (and chunk letter), idle dots."""
    lay = est.layout
    if lay.pp == 1:
        console.print("Timeline: no pipeline (pp=1); every device runs each microbatch forward then backward.")
        return
    multi = lay.pp_virtual_stages > 1
    cell = 5 if multi else 4
    m, slots, end = _fitting_slots(est, console.width, cell)
    colours = ["cyan", "magenta", "yellow", "green", "blue", "red"]
    console.print(
        f"Timeline ({lay.pp_schedule}, {m} of {est.microbatches} microbatches; one column = one forward of one chunk; "
        f"F forward, B backward{', W weight gradient' if lay.pp_schedule in ZERO_BUBBLE_SCHEDULES else ''}, "
        f". idle{'; the letter is the model chunk on that rank' if multi else ''})"
    )
    for rank, row in slots.items():
        line = Text(f"rank {rank:<2} ")
        cursor = 0
        local = sorted({s.chunk for s in row})
        for s in sorted(row, key=lambda x: x.start):
            line.append(f"{'.':<{cell}}" * (s.start - cursor), style="dim")
            label = f"{s.kind}{s.microbatch}" + ("abcdefgh"[local.index(s.chunk)] if multi else "")
            line.append(f"{label:<{cell}}" * s.length, style=colours[local.index(s.chunk) % len(colours)])
            cursor = s.start + s.length
        line.append(f"{'.':<{cell}}" * (end - cursor), style="dim")
        console.print(line, no_wrap=True, overflow="crop")
    console.print(f"idle share in this picture: {simulated_bubble(slots):.1%} (formula at m={est.microbatches}: {est.bubble:.2%})")


def render_measured(measured, *, console) -> None:
    """The --measure table: estimate, measurement, relative difference."""
    table = Table(title="Estimate vs measurement (real model on CPU)", title_justify="left")
    for col in ("quantity", "estimate", "measured", "difference"):
        table.add_column(col, justify="right" if col != "quantity" else "left")
    for row in measured.rows:
        diff = "" if row.measured in (None, 0) else f"{(row.estimate - row.measured) / row.measured:+.2%}"
        table.add_row(row.name, f"{row.estimate:,.0f}", "n/a" if row.measured is None else f"{row.measured:,.0f}", diff)
    console.print(table)
    for note in measured.notes:
        console.print(f"note: {note}", markup=False)


def render_search(result, *, plan, why_text: str, console) -> None:
    """The ranked layouts, with paste-ready overrides, or what would make the request fit."""
    prof = plan.config.cluster.accelerator
    head = (
        f"Searched {result.evaluated:,} layouts of {plan.config.recipe} on {result.world} x {prof} in "
        f"{result.seconds:.2f} s ({result.rate:,.0f} layouts/s); {result.fitting:,} fit."
    )
    console.print(head, markup=False)
    if not result.ranked:
        none = (
            "Nothing fits."
            if not result.fitting
            else f"None of the {result.fitting:,} that fit is a valid plan with the other settings (llmforge plan names why)."
        )
        console.print(Text(none, style="bold red"))
        for line in result.suggestions:
            console.print(f"- {line}", markup=False)
        return
    if result.offloaded:
        console.print(result.offloaded, markup=False, style="yellow")
    table = Table(title="Fastest layouts that fit", title_justify="left", show_lines=True)
    for col, justify in (
        ("#", "right"),
        ("tokens/s", "right"),
        ("MFU", "right"),
        ("step", "right"),
        ("memory", "right"),
        ("bubble", "right"),
        ("layout", "left"),
    ):
        table.add_column(col, justify=justify)
    for i, est in enumerate(result.ranked, 1):
        cap = est.job.profile.memory_bytes
        table.add_row(
            str(i),
            f"{est.tokens_per_s:,.0f}",
            f"{est.mfu:.1%}",
            f"{est.step_s:.3g} s",
            f"{gib(est.worst.total)} ({est.worst.total / cap:.0%})",
            f"{est.bubble:.1%}",
            _short(est.layout),
        )
    console.print(table)
    if why_text:
        console.print(why_text, markup=False)
    console.print("Overrides, ready to paste:")
    for i, est in enumerate(result.ranked, 1):
        console.print(f"  #{i}: {_paste(est.layout, elastic=plan.config.cluster.min_nodes is not None)}", soft_wrap=True, markup=False)


def _short(layout) -> str:
    """dp8 tp2 pp4 zero1 sp | 1f1b v1 | mb1 | recompute none"""
    parts = [
        f"{n}{v}"
        for n, v in (("dp", layout.dp), ("tp", layout.tp), ("pp", layout.pp), ("cp", layout.cp), ("ep", layout.ep))
        if v > 1 or n == "dp"
    ]
    if layout.dp_replicate > 1:
        parts[0] = f"hsdp{layout.dp_replicate}x{layout.dp_shard}"
    parts.append(f"zero{layout.zero}" + (" sp" if layout.sequence_parallel else ""))
    if layout.pp > 1:
        parts.append(f"{layout.pp_schedule}" + (f" v{layout.pp_virtual_stages}" if layout.pp_virtual_stages > 1 else ""))
    parts += [f"mb{layout.micro_batch_size}", f"rc:{layout.recompute}"]
    if layout.offload != Offload.NONE or layout.offload_activations:
        parts.append("offload:" + "+".join(["states"] * (layout.offload == Offload.STATES) + ["activations"] * layout.offload_activations))
    return " ".join(parts)


def _paste(layout, *, elastic: bool = False) -> str:
    """Overrides without the defaults a user need not type (an elastic plan keeps parallel.dp=auto)."""
    keep = []
    for part in layout.overrides().split():
        key, value = part.split("=", 1)
        if key == "parallel.dp" and elastic:
            part = "parallel.dp=auto"
        if (key, value) in (("parallel.cp", "1"), ("parallel.ep", "1"), ("parallel.pp_virtual_stages", "1")):
            continue
        keep.append(part)
    return " ".join(keep)


def _allowance_words(est) -> str:
    if est.job.on_cpu:
        process = max(est.job.profile.runtime_reserved_bytes, CPU_PROCESS_BYTES)
        step = cpu_step_bytes(est.shape, micro_batch=est.layout.micro_batch_size)
        return f"process {gib(process)} (python, torch, gloo) + {gib(step)} step code and heap holes + {CPU_HEAP_SLACK:.0%} heap slack"
    return f"runtime {gib(est.job.profile.runtime_reserved_bytes)} + {FRAGMENTATION:.0%} fragmentation"
