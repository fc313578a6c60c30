"""Rich renderings of plans, config options and keys (no torch)."""

from __future__ import annotations

from typing import Dict

from rich.console import Console
from rich.table import Table
from rich.text import Text

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
        ("model", f"{m.num_layers} layers x {m.hidden_size}, {m.num_heads} heads{kv}, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, seq {m.seq_len}{moe}"),
        ("flavour", f"{m.norm}, {m.activation}, {m.position} positions, {'tied' if m.tie_embeddings else 'untied'} embeddings"),
        ("cluster", f"{cfg.cluster.nodes} node(s) x {plan.world_size // max(cfg.cluster.nodes, 1)} {cfg.cluster.accelerator} = world size {plan.world_size}"),
        ("layout", f"dp {plan.dp} x tp {p.tp} x pp {p.pp} x cp {p.cp}, ep {p.ep}; ZeRO-{p.zero}{', sequence parallel' if p.sequence_parallel else ''}"),
        ("pipeline", f"{p.pp_schedule}, {p.pp_virtual_stages} virtual stage(s), layers per stage {plan.layers_per_stage}" if p.pp > 1 else "none"),
        ("recompute", p.recompute + (f" (every {p.recompute_every} blocks)" if p.recompute_every > 1 else "")),
        ("precision", f"compute {cfg.precision.param_dtype}, gradient reduction {cfg.precision.reduce_dtype}"),
        ("batch", f"global {t.global_batch_size} seqs = {plan.tokens_per_step:,} tokens/step; micro {t.micro_batch_size} x {plan.microbatches} microbatches per dp rank"),
        ("schedule", f"{t.steps} steps, lr {t.lr:g} ({cfg.optim.schedule}, warm-up {cfg.optim.warmup_steps}), seed {t.seed}"),
        ("data", cfg.data.source if cfg.data.source == "builtin" else f"{cfg.data.path or cfg.data.mixture}"),
        ("run dir", cfg.run.dir),
    ]
    for key, value in rows:
        table.add_row(key, Text(value))
    console.print(table)


def show_options(options: Dict[str, Dict[str, object]], *, console: Console) -> None:
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
    from llmforge.config.compose import compose
    from llmforge.config.schema import iter_keys, values_by_key

    values = values_by_key(compose([]))
    table = Table(show_header=True, header_style="bold", caption="default: the value `llmforge pretrain` uses with no overrides")
    for col in ("key", "type", "default", "meaning"):
        table.add_column(col)
    for key, typ, _, help_text in iter_keys():
        if key.startswith(prefix):
            kind = typ.replace("Optional[", "").rstrip("]") if "Optional" in typ else typ
            table.add_row(key, kind, Text(repr(values.get(key))), Text(help_text))
    console.print(table)

