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
    """The FP8 verdict of an FP8 plan (None: not FP8 on FP8 hardware). Unless ``force``, an FP8 plan
    is refused where it cannot pay: on FP8 hardware without ``train.compile`` or where the estimate
    says it does not pay (llmforge.estimate.fp8_report), and emulated where it would convert nothing."""
    from llmforge.estimate.fp8_report import fp8_verdict

    verdict = fp8_verdict(est)
    if force or not plan.config.precision.fp8:
        return verdict
    problems = _emulated_fp8_problems(plan) if plan.config.precision.fp8_emulate else _fp8_speed_problems(plan, verdict)
    if problems:
        raise UserError(problems, title="FP8 does not pay for this plan")
    return verdict


def _emulated_fp8_problems(plan: RunPlan) -> list[Problem]:
    """Emulated FP8 tests numerics, never speed: refused only where it would convert no linear."""
    if fp8_choice_of(plan.config) != Fp8Choice(frozenset(), frozenset()):
        return []
    rule = "no block linear of this model is large enough for float8 to pay, so emulated FP8 would convert none"
    fix = "set precision.fp8_linears=all to emulate every linear whose dimensions are multiples of 16, or pass --force"
    return [Problem("precision.fp8_linears", plan.config.precision.fp8_linears, rule, fix)]


def _fp8_speed_problems(plan: RunPlan, verdict: Fp8Verdict | None) -> list[Problem]:
    """FP8 on FP8 tensor cores runs compiled and gains by the estimate."""
    if verdict is None:  # a profile without FP8: refused by the plan itself
        return []
    out = []
    if not plan.config.train.compile:
        rule = (
            f"precision.fp8 on {plan.config.cluster.accelerator} needs compiled blocks: in eager mode each float8 linear's amax "
            "reductions and casts run as dozens of separate kernels, and FP8 trains slower than bf16 (0.31x of it measured on an H200)"
        )
        out.append(Problem("train.compile", False, rule, "set train.compile=true, use precision=bf16, or pass --force"))
    return out + verdict.problems()


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
