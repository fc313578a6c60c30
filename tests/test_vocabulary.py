"""One vocabulary: the choice keys are enums (``llmforge.config.choices``) read from the
schema's types, code compares enum members and never the names (checked with ``ast``,
nothing imported but the schema), and the trainer's side reads the parallel settings from
``plan.layout`` only. The names still read, print and serialise as plain strings."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import llmforge.config.choices as choices
from llmforge.config.choices import Choice, Recompute, Schedule
from llmforge.config.compose import compose
from llmforge.config.saved import compose_saved
from llmforge.config.schema import choice_keys, iter_keys
from llmforge.errors import UserError
from llmforge.plan import CHOICES, RunPlan, config_from_dict

PACKAGE = Path(__file__).resolve().parents[1] / "llmforge"
#: Names that hold a choice besides the schema's own field names (parameters and locals).
ALIASES: dict[str, tuple[type[Choice], ...]] = {
    "action": (choices.AnomalyAction,),
    "choice": (choices.Rehearse,),
    "mask": (choices.AttentionMask,),
    "sched": (choices.Schedule,),
    "schedule": (choices.Schedule, choices.LrSchedule),
    "mode": (choices.Recompute, choices.MemorySnapshot, choices.WandbMode),
    "scheme": (choices.Qat,),
    "optimizer": (choices.Optimizer,),
    "recipe": (choices.Fp8Recipe,),
    "shape": (choices.DecayShape,),
    "dtype": (choices.Dtype,),
}
#: Packages on the trainer's side of the plan: they read the parallel settings from plan.layout
#: (``rehearse/`` is left out: it rewrites a plan's config to plan the rehearsal).
LAYOUT_READERS = ("train", "parallel", "checkpoint", "launch", "observe", "models", "data", "calibrate", "processes")


def _names_holding_choices() -> dict[str, set[str]]:
    """Attribute or variable name -> the choice names it may hold (a field's leaf name, or an alias)."""
    out: dict[str, set[str]] = {}
    for key, kind in choice_keys().items():
        out.setdefault(key.rsplit(".", 1)[1], set()).update(kind.names())
    for name, kinds in ALIASES.items():
        for kind in kinds:
            out.setdefault(name, set()).update(kind.names())
    return out


def _holder(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _literals(node: ast.expr) -> set[str]:
    """The string literal, or the literals of a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def string_comparisons(source: str, names: dict[str, set[str]]) -> list[str]:
    """``line: code`` of each comparison between a name holding a choice and one of its names as a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for left, right in zip(sides, sides[1:], strict=False):
            for holder, literal in ((left, right), (right, left)):
                name = _holder(holder)
                if name in names and _literals(literal) & names[name]:
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_string_comparison_of_a_choice_outside_its_enum_module():
    names = _names_holding_choices()
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{hit}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "choices.py" or path.parent.name != "config"
        for hit in string_comparisons(path.read_text(), names)
    ]
    assert not found, "compare the enum members of llmforge.config.choices instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "code,flagged",
    [
        ('if plan.layout.recompute == "full": pass', True),
        ('if layout.pp_schedule in ("zbv", "gpipe"): pass', True),
        ('if "states" != cfg.parallel.offload: pass', True),
        ('if mode == "selective": pass', True),
        ("if plan.layout.recompute == Recompute.FULL: pass", False),
        ('if device.type == "cpu": pass', False),  # not a choice key
        ('if mode == "rb": pass', False),  # a name no choice has
    ],
)
def test_the_scan_finds_string_comparisons_of_choices_only(code, flagged):
    assert bool(string_comparisons(code, _names_holding_choices())) is flagged


def _is_config(node: ast.expr) -> bool:
    owner = ast.unparse(node)
    return owner in ("cfg", "config") or owner.endswith(".config")


def _config_parallel_reads(source: str) -> list[str]:
    """``config.parallel`` (any spelling of the config) and ``config.train.micro_batch_size``: Layout's fields."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        parallel = node.attr == "parallel" and _is_config(node.value)
        batch = node.attr == "micro_batch_size" and isinstance(node.value, ast.Attribute) and node.value.attr == "train"
        if parallel or (batch and _is_config(node.value.value)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_trainer_reads_the_layout_never_config_parallel():
    """RunPlan derives the layout (Layout.from_config); the torch side reads plan.layout."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{hit}"
        for package in LAYOUT_READERS
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for hit in _config_parallel_reads(path.read_text())
    ]
    assert not found, "read plan.layout instead:\n" + "\n".join(found)
    assert len(_config_parallel_reads("z = plan.config.parallel.zero\np = cfg.parallel\nb = cfg.train.micro_batch_size")) == 3


def test_choices_and_keys_come_from_the_schema_types():
    kinds = choice_keys()
    assert kinds["parallel.recompute"] is Recompute and kinds["parallel.pp_schedule"] is Schedule
    assert CHOICES["parallel.recompute"] == ("none", "selective", "full")
    assert set(CHOICES) == set(kinds) and len(kinds) >= 20
    types = {key: kind for key, kind, *_ in iter_keys()}
    assert types["parallel.recompute"] == "none|selective|full" and types["train.steps"] == "int"


def test_names_compose_to_members_and_serialise_as_plain_strings():
    plan = RunPlan.build(compose(["parallel.recompute=full", "parallel.pp_schedule=gpipe", "precision=bf16"]))
    assert plan.layout.recompute is Recompute.FULL and plan.layout.pp_schedule is Schedule.GPIPE
    saved = json.loads(plan.to_json())
    assert saved["config"]["parallel"]["recompute"] == "full" and type(saved["config"]["parallel"]["recompute"]) is str
    assert f"{plan.layout.recompute}" == "full" and plan.layout.recompute == "full"
    assert "parallel.recompute=full" in plan.layout.overrides()
    again = config_from_dict(saved["config"])  # a saved plan (plan.json, a checkpoint's) loads back
    assert again.parallel.recompute is Recompute.FULL and again == plan.config


WRONG = "parallel.recompute = 'fulll': not a valid choice (did you mean 'full'?). Fix: use one of: none, selective, full"


def test_a_wrong_name_is_reported_with_every_other_problem():
    with pytest.raises(UserError) as info:
        RunPlan.build(compose(["parallel.recompute=fulll", "model.norm=batchnorm", "train.steps=0"]))
    text = info.value.message()
    assert info.value.exit_code == 2 and WRONG in text
    assert "model.norm = 'batchnorm'" in text and "train.steps = 0" in text


def test_a_wrong_name_in_a_file_or_on_a_saved_plan_names_the_key_and_the_choices(tmp_path):
    (tmp_path / "parallel").mkdir()
    (tmp_path / "parallel" / "mine.yaml").write_text("recompute: fulll\n")
    with pytest.raises(UserError) as info:
        compose(["parallel=mine"], extra_dirs=[tmp_path])
    assert WRONG in info.value.message()
    saved = RunPlan.build(compose([])).to_dict()["config"]
    with pytest.raises(UserError) as info:
        RunPlan.build(compose_saved(saved, ["parallel.recompute=fulll"], source="plan.json"))
    assert WRONG in info.value.message()
