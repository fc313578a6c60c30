"""``llmforge data prepare``: prepare the data of a run plan and print a short summary."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmforge.config.schema import RunConfig
from llmforge.data.prepare import PreparedData, prepare
from llmforge.errors import Problem, UserError
from llmforge.plan import RunPlan


def resolve_vocab_size(config: RunConfig) -> int:
    """data.vocab_size, or model.vocab_size when unset; never larger than the model's embedding."""
    from llmforge.plan import tokenizer_problems

    problems = tokenizer_problems(config)
    if problems:
        raise UserError(problems, title="invalid vocabulary size")
    vocab_size = config.data.vocab_size or config.model.vocab_size
    if vocab_size > config.model.vocab_size:
        raise UserError(
            [
                Problem(
                    "data.vocab_size",
                    vocab_size,
                    f"larger than model.vocab_size ({config.model.vocab_size}): token ids would overflow the embedding",
                    f"set model.vocab_size={vocab_size} or lower data.vocab_size",
                )
            ],
            title="invalid vocabulary size",
        )
    return vocab_size


def prepare_command(plan: RunPlan, *, force: bool, console) -> PreparedData:
    """Prepare (or reuse) the data of a run plan and print what is on disk."""
    config = plan.config
    prepared = prepare(data=config.data, vocab_size=resolve_vocab_size(config), seed=config.train.seed, console=console, force=force)
    if console is not None:
        console.print(summary(prepared), markup=False, highlight=False)
    return prepared


def summary(prepared: PreparedData) -> str:
    """A few lines describing prepared data."""
    state = "reused cache" if prepared.reused else "prepared"
    lines = [
        f"{state}: {prepared.root}",
        f"  tokenizer: {prepared.tokenizer_path} ({prepared.vocab_size} tokens, eos id {prepared.eos_id}, {prepared.dtype} shards)",
    ]
    for info in prepared.streams:
        size_mb = info.num_tokens * (2 if prepared.dtype == "uint16" else 4) / 1e6
        lines.append(
            f"  {info.name}: {info.num_documents:,} documents, {info.num_tokens:,} tokens ({size_mb:.1f} MB), weight {info.weight:g}"
        )
    return "\n".join(lines)


def data_prepare_command(overrides: Sequence[str], *, config_dir: Sequence[Path], force: bool, console) -> PreparedData:
    """``llmforge data prepare``: the plan of the recipe and overrides, its data prepared."""
    from llmforge.commands.plans import build_plan

    return prepare_command(build_plan(overrides, config_dir=config_dir), force=force, console=console)
