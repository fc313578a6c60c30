"""``llmforge plan``, ``recipes``, ``keys`` and ``estimate``: show, start nothing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from llmforge.commands.plans import build_plan, check_fp8_pays, plan_estimate, plan_from_file

#: What ``estimate --search`` starts from: plain data parallelism over the cluster, so
#: that a recipe's own layout cannot make the request invalid (the search varies it).
SEARCH_START = {"parallel": "dp"}


def plan_command(overrides: Sequence[str], *, as_json: bool, config_dir: Sequence[Path], console: Console, force: bool = False) -> None:
    run_plan = build_plan(overrides, config_dir=config_dir)
    note_launch_needs(run_plan)
    verdict = check_fp8_pays(run_plan, plan_estimate(run_plan), force=force) if run_plan.config.precision.fp8 else None
    if as_json:
        print(run_plan.to_json())
        return
    from llmforge.report import show_plan

    show_plan(run_plan, console=console)
    for line in verdict.lines() if verdict is not None else ():
        console.print(line, highlight=False)


def recipes_command(*, config_dir: Sequence[Path], console: Console) -> None:
    from llmforge.config.compose import available_options, config_dirs
    from llmforge.report import show_options

    show_options(available_options(config_dirs(list(config_dir))), console=console)


def keys_command(prefix: str, *, console: Console) -> None:
    from llmforge.report import show_keys

    show_keys(prefix, console=console)


def estimate_command(
    overrides: Sequence[str],
    *,
    plan_file: Path | None,
    config_dir: Sequence[Path],
    as_json: bool,
    timeline: bool,
    measure: bool,
    search: bool,
    top: int,
    console: Console,
    rehearse: bool = False,
    force: bool = False,
) -> None:
    reset = SEARCH_START if search else None
    if plan_file is not None:
        run_plan = plan_from_file(plan_file, overrides, config_dir=config_dir, reset=reset)
    else:
        run_plan = build_plan(overrides, config_dir=config_dir, reset=reset)
    note_launch_needs(run_plan, refuse=measure or rehearse)
    from llmforge.commands.estimate import run_estimate

    options = {"timeline": timeline, "measure": measure, "search": search, "top": top, "rehearse": rehearse, "force": force}
    run_estimate(run_plan, as_json=as_json, console=console, **options)


def note_launch_needs(run_plan, *, refuse: bool = False) -> None:
    """One line on stderr for each thing launching will need that this machine lacks
    (torchao for precision.fp8); ``refuse``: running the model here (``--measure``) needs it now."""
    from llmforge.errors import UserError
    from llmforge.plan import launch_problems

    problems = launch_problems(run_plan.config)
    if problems and refuse:
        raise UserError(problems, title="cannot run the model on this machine")
    for problem in problems:
        Console(stderr=True).print(
            f"note: {problem.key}: {problem.rule}; launching will need it ({problem.fix})",
            style="yellow",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
