"""Plans for the commands: composed from a recipe and overrides, or read back from a
run's plan.json with overrides on top (``llmforge.config.compose`` and ``.saved``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llmforge.blockspec.fp8 import Fp8Choice, fp8_choice_of
from llmforge.errors import Problem, UserError
from llmforge.plan import RunPlan

if TYPE_CHECKING:
    from llmforge.estimate.attention import Documents
    from llmforge.estimate.core import Estimate
    from llmforge.estimate.fp8_report import Fp8Verdict


def build_plan(overrides: Sequence[str], *, config_dir: Sequence[Path] = (), reset: Mapping[str, str] | None = None) -> RunPlan:
    """The validated plan of a recipe with ``overrides`` (and ``--config-dir`` folders)."""
    from llmforge.config.compose import compose

    return RunPlan.build(compose(list(overrides), extra_dirs=list(config_dir), reset=reset))


def plan_documents(plan: RunPlan) -> Documents | None:
    """The prepared data's document lengths where the plan's attention mask follows documents,
    read here, once, for the estimate (which reads no files); None: not needed or not prepared."""
    from llmforge.data.prepare import document_ends_for

    return document_ends_for(plan.config, vocab_size=plan.data_vocab_size)


def plan_estimate(plan: RunPlan) -> Estimate:
    """The one estimate of a command's plan (the prepared data's document lengths included)."""
    from llmforge.estimate.core import estimate_plan

    return estimate_plan(plan, documents=plan_documents(plan))


def check_fp8_pays(plan: RunPlan, est: Estimate, *, force: bool) -> Fp8Verdict | None:
    """The FP8 verdict of an FP8 plan (None: not FP8 on FP8 hardware); an FP8 plan that does not
    pay is refused unless forced or emulated (llmforge.estimate.fp8_report), and an emulated one
    that would convert no linear at all unless forced."""
    from llmforge.estimate.fp8_report import fp8_verdict

    precision = plan.config.precision
    if precision.fp8 and precision.fp8_emulate and not force and fp8_choice_of(plan.config) == Fp8Choice(frozenset(), frozenset()):
        rule = "no block linear of this model is large enough for float8 to pay, so emulated FP8 would convert none"
        fix = "set precision.fp8_linears=all to emulate every linear whose dimensions are multiples of 16, or pass --force"
        raise UserError([Problem("precision.fp8_linears", precision.fp8_linears, rule, fix)], title="FP8 converts nothing")
    verdict = fp8_verdict(est)
    if verdict is not None and not force and not plan.config.precision.fp8_emulate:
        problems = verdict.problems()
        if problems:
            raise UserError(problems, title="FP8 does not pay for this plan")
    return verdict


def plan_from_file(
    path: Path, overrides: Sequence[str], *, config_dir: Sequence[Path] = (), reset: Mapping[str, str] | None = None
) -> RunPlan:
    """A run's plan.json, with overrides applied on top of it (group options also from ``config_dir``)."""
    from llmforge.config.saved import compose_saved

    if path.is_dir():  # a run folder: its plan.json
        if not (path / "plan.json").is_file():
            raise UserError(
                [Problem("--plan", str(path), "is a folder without a plan.json", "point --plan at a run folder or its plan.json")],
                title="missing plan",
            )
        path = path / "plan.json"
    try:
        saved = json.loads(path.read_text())["config"]
    except FileNotFoundError:
        raise UserError(
            [Problem("--plan", str(path), "no such file", "point --plan at a run folder's plan.json")], title="missing plan"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a damaged file: one message
        raise UserError(
            [Problem("--plan", str(path), f"cannot read the plan ({exc})", "point --plan at a run folder's plan.json")],
            title="unreadable plan",
        ) from None
    if not isinstance(saved, dict):
        raise UserError(
            [Problem("--plan", str(path), "cannot read the plan (no config section)", "point --plan at a run folder's plan.json")],
            title="unreadable plan",
        )
    return RunPlan.build(compose_saved(saved, overrides, source=path, extra_dirs=config_dir, reset=reset))
