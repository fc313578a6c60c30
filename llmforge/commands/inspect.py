"""``llmforge plan``, ``recipes``, ``keys`` and ``estimate``: show, start nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console

from llmforge.commands.plans import build_plan, plan_from_file

#: What ``estimate --search`` starts from: plain data parallelism over the cluster, so
#: that a recipe's own layout cannot make the request invalid (the search varies it).
SEARCH_START = {"parallel": "dp"}


def plan_command(overrides: Sequence[str], *, as_json: bool, config_dir: Sequence[Path], console: Console) -> None:
    run_plan = build_plan(overrides, config_dir=config_dir)
    if as_json:
        print(run_plan.to_json())
        return
    from llmforge.report import show_plan

    show_plan(run_plan, console=console)


def recipes_command(*, config_dir: Sequence[Path], console: Console) -> None:
    from llmforge.config.compose import available_options, config_dirs
    from llmforge.report import show_options

    show_options(available_options(config_dirs(list(config_dir))), console=console)


def keys_command(prefix: str, *, console: Console) -> None:
    from llmforge.report import show_keys

    show_keys(prefix, console=console)


def estimate_command(overrides: Sequence[str], *, plan_file: Optional[Path], config_dir: Sequence[Path], as_json: bool, timeline: bool,
                     measure: bool, search: bool, top: int, console: Console) -> None:
    reset = SEARCH_START if search else None
    if plan_file is not None:
        run_plan = plan_from_file(plan_file, overrides, config_dir=config_dir, reset=reset)
    else:
        run_plan = build_plan(overrides, config_dir=config_dir, reset=reset)
    from llmforge.commands.estimate import run_estimate

    run_estimate(run_plan, as_json=as_json, timeline=timeline, measure=measure, search=search, top=top, console=console)
