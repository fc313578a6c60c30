"""Rich renderings of plans, config options and keys (no torch)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmforge.config.choices import AnomalyAction, DataSource, Offload, Qat
from llmforge.config.compose import compose
from llmforge.config.schema import iter_keys, values_by_key
from llmforge.plan import RunPlan


def show_plan(plan: RunPlan, *, console: Console) -> None:
    cfg = plan.config
    m, p, t = cfg.model, cfg.parallel, cfg.train
    table = Table(title=Text(f"run plan: recipe {cfg.recipe}"), show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    kv = "" if plan.num_kv_heads == m.num_heads else f", {plan.num_kv_heads} kv heads (GQA)"
    moe = f", MoE {m.moe.num_experts} experts top-{m.moe.top_k} on {len(plan.moe_layers)} layers" if m.moe.num_experts else ""
    rows = [
        (
            "model",
            f"{m.num_layers} layers x {m.hidden_size}, {m.num_heads} heads{kv}, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, seq "
            f"{m.seq_len}{moe}",
        ),
        ("flavour", f"{m.norm}, {m.activation}, {m.position} positions, {'tied' if m.tie_embeddings else 'untied'} embeddings"),
        (
            "cluster",
            f"{cfg.cluster.nodes} node(s) x {plan.world_size // max(cfg.cluster.nodes, 1)} {cfg.cluster.accelerator} = world size "
            f"{plan.world_size}"
            + (f"; elastic: {cfg.cluster.min_nodes}-{cfg.cluster.nodes} nodes" if cfg.cluster.min_nodes is not None else ""),
        ),
        (
            "layout",
            f"dp {plan.dp} x tp {p.tp} x pp {p.pp} x cp {p.cp}, ep {p.ep}; "
            f"ZeRO-{p.zero}{', sequence parallel' if p.sequence_parallel else ''}",
        ),
        (
            "pipeline",
            f"{p.pp_schedule}, {p.pp_virtual_stages} virtual stage(s), layers per stage {plan.layers_per_stage}" if p.pp > 1 else "none",
        ),
        ("recompute", p.recompute + (f" (every {p.recompute_every} blocks)" if p.recompute_every > 1 else "")),
        ("attention", _attention(m)),
        ("offload", _offload(p)),
        (
            "precision",
            f"compute {cfg.precision.param_dtype}, gradient reduction {cfg.precision.reduce_dtype}"
            + (f", FP8 {cfg.precision.fp8_recipe}{' (emulated)' if cfg.precision.fp8_emulate else ''}" if cfg.precision.fp8 else "")
            + _qat(cfg.precision),
        ),
        (
            "batch",
            f"global {t.global_batch_size} seqs = {plan.tokens_per_step:,} tokens/step; micro {t.micro_batch_size} x {plan.microbatches} "
            "microbatches per dp rank",
        ),
        ("schedule", f"{t.steps} steps, lr {t.lr:g} ({cfg.optim.schedule}, warm-up {cfg.optim.warmup_steps}), seed {t.seed}"),
        ("anomaly", _anomaly(t)),
        ("data", cfg.data.source if cfg.data.source == DataSource.BUILTIN else f"{cfg.data.path or cfg.data.mixture}"),
        ("run dir", cfg.run.dir),
        ("checkpoints", f"{plan.checkpoint_root}, keep {cfg.checkpoint.keep}" + (", async" if cfg.checkpoint.async_save else "")),
    ]
    for key, value in rows:
        table.add_row(key, Text(value))
    console.print(table)


def _attention(m) -> str:
    """The mask, the sliding window and its layers, and the positions."""
    text = f"{m.attention_mask} mask"
    if m.sliding_window:
        layers = list(m.sliding_window_layers) or [i for i in range(m.num_layers) if i % m.sliding_window_every == 0]
        which = "every layer" if len(layers) == m.num_layers else f"layers {', '.join(map(str, layers))}"
        text += f", sliding window {m.sliding_window} on {which}"
    return text + (", positions restart at each document" if m.position_reset else "")


def _offload(p) -> str:
    parts = (["states (master weights, gradients, AdamW moments; CPU AdamW)"] if p.offload == Offload.STATES else []) + (
        ["saved activations"] if p.offload_activations else []
    )
    return " + ".join(parts) + " in host memory" if parts else "none"


def _anomaly(t) -> str:
    """train.anomaly and the limits it uses."""
    if t.anomaly == AnomalyAction.STOP:
        return "a non-finite step stops the run"
    rollback = f", at most {t.max_rollbacks} rollback(s)" if t.anomaly == AnomalyAction.ROLLBACK else ""
    then = "stop" if t.anomaly == AnomalyAction.SKIP else "roll back"
    return f"{t.anomaly}: a non-finite step is skipped; more than {t.max_skipped_steps} in a row {then}{rollback}" + (
        ", loss spikes too" if t.loss_spike_skip else ""
    )


def show_options(options: dict[str, dict[str, object]], *, console: Console) -> None:
    for group, entries in options.items():
        table = Table(title=f"{group}=", title_justify="left", show_header=False, box=None, padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for name, info in sorted(entries.items()):
            table.add_row(Text(name), Text(info.description))  # type: ignore[attr-defined]
        console.print(table)
        console.print()


def show_keys(prefix: str, *, console: Console) -> None:
    """Every key with its type, its value in the default run (`llmforge pretrain` with no
    overrides: the schema's defaults under the default recipe) and its help."""
    values = values_by_key(compose([]))
    table = Table(show_header=True, header_style="bold", caption="default: the value `llmforge pretrain` uses with no overrides")
    table.add_column("key", no_wrap=True)  # whole, to copy into an override
    for col in ("type", "default", "meaning"):
        table.add_column(col)
    for key, typ, _, help_text in iter_keys():
        if key.startswith(prefix):
            kind = typ.removesuffix(" | None").replace("|", " | ")  # a choice's names wrap between them
            table.add_row(key, kind, Text(repr(values.get(key))), Text(help_text))
    console.print(table)


def _qat(pr) -> str:
    """', QAT int8-int4 (group 32) from step N' or ''."""
    if pr.qat == Qat.NONE:
        return ""
    return f", QAT {pr.qat} (group {pr.qat_group_size})" + (f" from step {pr.qat_start_step}" if pr.qat_start_step > 1 else "")
