"""Random overrides, values and recipe files thrown at `plan`, `estimate` and
`pretrain --dry-run`: every answer is exit code 0 or 2, never a traceback, and
nothing is written. Derandomized, so CI sees the same examples every run."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.compose import BUILTIN_CONFIG_DIR, SELECTABLE_GROUPS
from llmforge.config.schema import iter_keys

#: Examples per command (three commands, 75 in all, and half as many for saved plans and
#: shadowing options): about 0.1-0.3 s each on a quiet machine.
EXAMPLES = 25

KEYS = sorted(k for k, *_ in iter_keys())
OPTIONS = {g: sorted(p.stem for p in (BUILTIN_CONFIG_DIR / g).glob("*.yaml")) for g in SELECTABLE_GROUPS}
ODD = [
    "",
    "0",
    "-1",
    "1e309",
    "nan",
    "-inf",
    "true",
    "null",
    "[]",
    "[1,2]",
    "{}",
    "{a: 1}",
    "'x[/y]'",
    "x[/y]",
    "${oc.env:HOME}",
    "${nope}",
    "'='",
    "==1",
    "a,b",
    "9" * 30,
    "'[bold]x[/]'",
    "~",
    "auto",
    "1.5",
    "\\",
    "'",
]
SCALARS = st.one_of(
    st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=12), st.sampled_from(ODD)
)


def _value_text(value) -> str:
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


override = st.one_of(
    st.builds(lambda k, v: f"{k}={_value_text(v)}", st.sampled_from(KEYS), SCALARS),
    st.builds(
        lambda g, o: f"{g}={o}",
        st.sampled_from(sorted(OPTIONS)),
        st.one_of(st.sampled_from(sum(OPTIONS.values(), [])), st.text(max_size=8)),
    ),
    st.text(max_size=20),
)


def _nest(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


recipe = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), SCALARS, max_size=4).map(_nest),
    st.recursive(
        SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=6
    ),
    st.text(max_size=40),
)
COMMANDS = {"plan": ["plan"], "estimate": ["estimate"], "pretrain": ["pretrain", "--dry-run"]}


def _check(
    command: str, overrides: list[str], recipe_text: str | None, *, files: dict[str, str] | None = None, args: tuple[str, ...] = ()
) -> None:
    """Run ``command`` in an empty folder holding ``files`` (and a recipe ``fuzz`` if given);
    ``args`` name paths relative to that folder as ``{root}/...``."""
    runner = CliRunner()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        extra: list[str] = [a.format(root=root) for a in args]
        if recipe_text is not None:
            files = {**(files or {}), "cfg/recipe/fuzz.yaml": recipe_text}
            extra += ["-C", str(root / "cfg"), "recipe=fuzz"]
        for name, text in (files or {}).items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        before = sorted(p.relative_to(root) for p in root.rglob("*"))
        cwd = os.getcwd()
        os.chdir(root)
        try:
            result = runner.invoke(app, [*COMMANDS[command], *extra, *overrides])
        finally:
            os.chdir(cwd)
        shown = f"{command} {extra} {overrides}\n{result.output}"
        assert result.exit_code in (0, 2), shown
        assert result.exception is None or isinstance(result.exception, SystemExit), shown + repr(result.exception)
        assert "Traceback" not in result.output, shown
        assert sorted(p.relative_to(root) for p in root.rglob("*")) == before, shown


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)


@FUZZ
@given(overrides=st.lists(override, max_size=4))
def test_plan_survives_random_overrides(overrides):
    _check("plan", overrides, None)


@FUZZ
@given(overrides=st.lists(override, max_size=3), body=recipe)
def test_estimate_survives_random_overrides_and_recipes(overrides, body):
    text = body if isinstance(body, str) else "# @package _global_\n" + yaml.safe_dump(body)
    _check("estimate", overrides, text)


@FUZZ
@given(overrides=st.lists(override, max_size=3), body=st.one_of(st.none(), recipe))
def test_pretrain_dry_run_survives_random_overrides_and_recipes(overrides, body):
    text = None if body is None else body if isinstance(body, str) else "# @package _global_\n" + yaml.safe_dump(body)
    _check("pretrain", overrides, text)


#: One value of each class the plan must refuse before a command writes anything (no dry run).
REFUSED_VALUES = ["train.seed=-5", "train.lr=1e309", "model.init_std=nan", "optim.beta2=1.5", f"train.steps={2**63}"]


def test_pretrain_refuses_each_value_class_before_writing_anything(tmp_path):
    runner = CliRunner()
    for value in REFUSED_VALUES:
        run_dir = tmp_path / "run"
        result = runner.invoke(app, ["pretrain", f"run.dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}", value])
        key = value.split("=")[0]
        assert result.exit_code == 2 and f"{key} = " in result.output and "Traceback" not in result.output, result.output
        assert list(tmp_path.iterdir()) == [], (value, list(tmp_path.rglob("*")))


#: A saved plan's keys, with some this version does not have.
PLAN_KEYS = KEYS + ["model.flash", "bogus", "model.moe", "train", "parallel.pp_layers.0"]


@functools.cache
def _default_plan() -> str:
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    return RunPlan.build(compose([])).to_json()


def _saved_plan(edits: dict) -> str:
    """The default run's plan.json with ``edits`` (dotted key -> value) written into it."""
    data = json.loads(_default_plan())
    for key, value in edits.items():
        node = data["config"]
        *parents, leaf = key.split(".")
        for part in parents:
            node[part] = node[part] if isinstance(node.get(part), dict) else {}
            node = node[part]
        node[leaf] = value
    return json.dumps(data, allow_nan=True)


@settings(FUZZ, max_examples=EXAMPLES // 2)
@given(edits=st.dictionaries(st.sampled_from(PLAN_KEYS), SCALARS, min_size=1, max_size=3), overrides=st.lists(override, max_size=2))
def test_estimate_survives_plans_of_other_versions(edits, overrides):
    _check("estimate", overrides, None, files={"run/plan.json": _saved_plan(edits)}, args=("--plan", "{root}/run/plan.json"))


@settings(FUZZ, max_examples=EXAMPLES // 2)
@given(body=recipe, overrides=st.lists(override, max_size=2))
def test_plan_survives_user_options_that_shadow_built_in_ones(body, overrides):
    text = body if isinstance(body, str) else yaml.safe_dump(body)
    _check("plan", ["parallel=dp2", *overrides], None, files={"cfg/parallel/dp2.yaml": text}, args=("-C", "{root}/cfg"))
