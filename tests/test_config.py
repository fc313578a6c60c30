"""Composition and validation: every recipe composes, every rule reports key, value and fix."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest

from llmforge.config.compose import available_options, compose, config_dirs
from llmforge.config.ranges import Range, range_problems
from llmforge.config.schema import RunConfig, iter_keys
from llmforge.errors import UserError
from llmforge.plan import RunPlan
from llmforge.rundir import write_plan

RECIPES = sorted(available_options(config_dirs())["recipe"])


def build(*overrides: str) -> RunPlan:
    return RunPlan.build(compose(list(overrides)))


def problems_of(*overrides: str) -> str:
    with pytest.raises(UserError) as info:
        build(*overrides)
    return info.value.message()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    plan = build(f"recipe={recipe}")
    assert plan.config.recipe == recipe
    assert plan.world_size == plan.dp * plan.layout.tp * plan.layout.pp * plan.layout.cp


@pytest.mark.parametrize(
    "recipe,parallel",
    [(r, p) for r in ("gpt-1b", "gpt-7b", "llama-8b") for p in ("dp", "tp4pp2", "tp2pp2", "fsdp", "zero1", "fsdp-tp2")]
    + [("gpt-7b", "tp8pp4"), ("llama-8b", "tp8pp4")],
)
def test_large_recipes_with_several_layouts(recipe, parallel):
    plan = build(f"recipe={recipe}", f"parallel={parallel}")
    assert plan.world_size == plan.config.cluster.nodes * plan.config.cluster.devices_per_node
    assert sum(plan.layers_per_stage) == plan.config.model.num_layers


@pytest.mark.parametrize("parallel", ["single", "dp2", "tp2", "tp2sp", "pp2", "tp2pp2", "dp2tp2", "zero2"])
def test_tiny_recipe_sizes_the_world_to_the_layout(parallel):
    plan = build(f"parallel={parallel}", "train.global_batch_size=64", "train.micro_batch_size=8")
    assert plan.world_size == plan.dp * plan.layout.tp * plan.layout.pp


def test_derived_values_gpt1b_tp4pp2():
    plan = build("recipe=gpt-1b", "parallel=tp4pp2")
    assert (plan.world_size, plan.dp, plan.layout.tp, plan.layout.pp) == (8, 1, 4, 2)
    assert plan.layers_per_stage == [12, 12]
    assert plan.microbatches == 512 // 4
    assert plan.tokens_per_step == 512 * 2048


def test_dp_auto_uses_the_rest_of_the_world():
    plan = build("recipe=gpt-7b")  # 4 nodes x 8, tp4 pp2
    assert plan.dp == 4 and plan.microbatches == 1024 // 4


def test_overrides_win_over_recipe_and_group():
    plan = build("recipe=gpt-1b", "parallel=tp2pp2", "parallel.tp=4", "train.steps=7")
    assert plan.layout.tp == 4 and plan.config.train.steps == 7


def test_checkpoint_async_alias():
    assert build("checkpoint.async=true").config.checkpoint.async_save is True


def test_plan_json_round_trip(tmp_path):
    plan = build("recipe=gpt-1b", "parallel=tp4pp2", f"run.dir={tmp_path}")
    again = RunPlan.load(write_plan(plan))
    assert again == plan
    assert json.loads(plan.to_json())["derived"]["layers_per_stage"] == [12, 12]


RULES = [
    (("recipe=gpt-1b", "cluster.devices_per_node=8", "parallel.dp=3", "parallel.tp=2"), "parallel.dp = 3", "world size is 8"),
    (("parallel.tp=3",), "parallel.tp = 3", "does not divide model.num_heads=4"),
    (("model.num_kv_heads=2", "model.num_heads=4", "parallel.tp=4", "train.global_batch_size=16"), "parallel.tp = 4", "num_kv_heads=2"),
    (("parallel.pp=3",), "model.num_layers = 4", "not divisible by pp x virtual stages = 3"),
    (("train.global_batch_size=18",), "train.global_batch_size = 18", "not divisible by micro_batch_size x dp"),
    (
        ("parallel=pp2", "parallel.pp_schedule=1f1b", "train.micro_batch_size=16", "train.global_batch_size=16"),
        "train.global_batch_size = 16",
        "fewer than parallel.pp=2",
    ),
    (("parallel.sequence_parallel=true",), "parallel.sequence_parallel = True", "tp=1"),
    (("parallel.cp=3",), "model.seq_len = 128", "not a multiple of 6: context parallelism (parallel.cp=3)"),
    (
        ("model=moe-tiny", "parallel.ep=3", "parallel.dp=3", "train.global_batch_size=48"),
        "parallel.ep = 3",
        "does not divide model.moe.num_experts=4",
    ),
    (("model=moe-tiny", "parallel.ep=2", "parallel.dp=1"), "parallel.ep = 2", "dp x cp = 1"),
    (("parallel.ep=2", "parallel.dp=2", "train.global_batch_size=32"), "parallel.ep = 2", "needs an MoE model"),
    (
        ("parallel.pp_virtual_stages=2", "parallel.pp=2", "train.global_batch_size=64", "train.micro_batch_size=8"),
        "parallel.pp_virtual_stages = 2",
        "one stage per rank",
    ),
    (("model.hidden_size=130",), "model.hidden_size = 130", "not divisible by model.num_heads=4"),
    (("parallel.zero=5",), "parallel.zero = 5", "0, 1, 2 or 3"),
    (("model.norm=batchnorm",), "model.norm = 'batchnorm'", "use one of: layernorm, rmsnorm"),
    (("train.steps=0",), "train.steps = 0", "positive integer"),
    (("data=files",), "data.path = None", "data.path=FILE_OR_FOLDER"),
    (("recipe=gpt-1b", "parallel.tp=16"), "parallel.tp = 16", "inside a node"),
    (("recipe=gpt-1b", "parallel=tp8pp4"), "parallel", "does not divide the world size 8"),
]


@pytest.mark.parametrize("overrides,head,detail", RULES, ids=[r[1] for r in RULES])
def test_each_rule_names_key_value_and_fix(overrides, head, detail):
    message = problems_of(*overrides)
    assert head in message and detail in message and "Fix:" in message


def test_all_problems_reported_at_once():
    message = problems_of("parallel.tp=3", "parallel.pp=3", "train.global_batch_size=10")
    assert "parallel.tp = 3" in message and "model.num_layers = 4" in message and "train.global_batch_size = 10" in message


VALUES_THAT_FAIL_LATER = [
    ("train.lr=1e309", "train.lr = inf", "finite"),
    ("model.init_std=nan", "model.init_std = nan", "finite"),
    ("model.rope_theta=0", "model.rope_theta = 0.0", "positive"),
    ("optim.beta2=1.5", "optim.beta2 = 1.5", "[0, 1)"),
    ("optim.eps=-1", "optim.eps = -1.0", "positive"),
    ("train.seed=-5", "train.seed = -5", "0 or more"),
    ("data.builtin_max_mb=1e309", "data.builtin_max_mb = inf", "finite"),
    (f"train.steps={2**63}", f"train.steps = {2**63}", "64-bit"),
    ("model.dropout=1", "model.dropout = 1.0", "[0, 1)"),
    ("cluster.max_restarts=-1", "cluster.max_restarts = -1", "0 or more"),
]


@pytest.mark.parametrize("override,head,detail", VALUES_THAT_FAIL_LATER, ids=[v[0] for v in VALUES_THAT_FAIL_LATER])
def test_values_that_would_fail_in_training_are_refused_by_the_plan(override, head, detail):
    message = problems_of(override)
    assert head in message and detail in message and "Fix:" in message


def _numeric_fields(cls=RunConfig, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _numeric_fields(type(default), f"{prefix}{f.name}.")
        elif any(t in str(f.type) for t in ("int", "float")) and "list" not in str(f.type).lower():
            yield f"{prefix}{f.name}", f


def test_every_numeric_key_declares_its_range_and_the_defaults_lie_inside():
    assert [key for key, f in _numeric_fields() if "range" not in f.metadata] == []
    assert range_problems(RunConfig()) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 2**63, -(2**63) - 1])
def test_every_numeric_key_refuses_non_finite_and_oversized_values(bad):
    config = compose([])
    keys = [key for key, f in _numeric_fields() if isinstance(bad, float) or "int" in str(f.type)]
    for key in keys:
        *parents, leaf = key.split(".")
        setattr(functools.reduce(getattr, parents, config), leaf, bad)
    flagged = {p.key for p in range_problems(config)}
    assert keys and set(keys) <= flagged, sorted(set(keys) - flagged)


def test_keys_help_shows_each_range():
    helps = {key: text for key, _, _, text in iter_keys()}
    assert helps["optim.beta2"].endswith("Range: [0, 1).") and helps["train.steps"].endswith("Range: [1, inf).")


def test_range_notation_is_checked_when_the_schema_is_read():
    assert str(Range.parse("[0, 1)")) == "[0, 1)" and 1 not in Range.parse("[0, 1)") and 0 in Range.parse("[0, 1)")
    for text in ("0, 1", "[1, 0]", "[a, 1)"):
        with pytest.raises(ValueError):
            Range.parse(text)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["recipe=gpt1b"], "did you mean 'gpt-1b'"),
        (["parallel=tp3"], "choose one of:"),
        (["model.hidden=3"], "did you mean 'model.hidden_size'"),
        (["train.steps=many"], "train.steps"),
        (["trainsteps"], "key=value"),
    ],
)
def test_bad_overrides(overrides, expected):
    with pytest.raises(UserError) as info:
        compose(overrides)
    assert expected in info.value.message()


def test_user_config_folder_adds_and_shadows_options(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "recipe").mkdir()
    (tmp_path / "model" / "my-model.yaml").write_text("# mine\nnum_layers: 6\nhidden_size: 96\nnum_heads: 4\nffn_hidden_size: 384\n")
    (tmp_path / "recipe" / "mine.yaml").write_text(
        "# @package _global_\n# my recipe\ndefaults:\n  - override /model: my-model\nrecipe: mine\ntrain:\n  steps: 3\n"
    )
    plan = RunPlan.build(compose(["recipe=mine"], extra_dirs=[tmp_path]))
    assert plan.config.model.num_layers == 6 and plan.config.train.steps == 3
    monkeypatch.setenv("LLMFORGE_CONFIG_PATH", str(tmp_path))
    assert RunPlan.build(compose(["model=my-model"])).config.model.hidden_size == 96


def test_bad_yaml_in_user_folder_is_a_user_error(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "broken.yaml").write_text("num_layers: [unclosed\n")
    with pytest.raises(UserError):
        compose(["model=broken"], extra_dirs=[tmp_path])


def test_unknown_key_in_user_yaml_is_a_user_error(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "typo.yaml").write_text("num_layer: 3\n")
    with pytest.raises(UserError) as info:
        compose(["model=typo"], extra_dirs=[tmp_path])
    assert "num_layer" in info.value.message()


def _user_folder(root, files: dict):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_user_option_shadows_the_built_in_one_of_the_same_name(tmp_path, monkeypatch):
    from llmforge.config.compose import BUILTIN_CONFIG_DIR

    tiny = (BUILTIN_CONFIG_DIR / "recipe" / "tiny.yaml").read_text()
    mine = tiny.replace("steps: 300", "steps: 2").replace("# The default:", "# My tiny:")
    first = _user_folder(tmp_path / "a", {"parallel/dp2.yaml": "# my dp2\ndp: 2\nzero: 2\n", "recipe/tiny.yaml": mine})
    second = _user_folder(tmp_path / "b", {"parallel/dp2.yaml": "# other dp2\ndp: 2\nzero: 1\n"})
    config = compose(["parallel=dp2"], extra_dirs=[first, second])
    assert config.parallel.zero == 2 and config.train.steps == 2  # the first folder wins, the default recipe is the user's
    assert compose(["parallel=dp2"], extra_dirs=[second]).parallel.zero == 1
    listed = available_options(config_dirs([first, second]))
    assert listed["recipe"]["tiny"].description.startswith("My tiny") and listed["parallel"]["dp2"].path == first / "parallel" / "dp2.yaml"
    monkeypatch.setenv("LLMFORGE_CONFIG_PATH", f"{first}:{second}")
    config = compose(["recipe=tiny", "parallel=dp2"])
    assert config.parallel.zero == 2 and config.train.steps == 2
    monkeypatch.delenv("LLMFORGE_CONFIG_PATH")
    assert compose(["parallel=dp2"]).parallel.zero == 0 and compose([]).train.steps == 300  # the built-in ones, untouched


def test_a_shadowing_user_option_is_checked_against_the_schema(tmp_path):
    folder = _user_folder(tmp_path, {"parallel/dp2.yaml": "# my dp2\ndp: 2\nzero: 2\nbogus: 1\n"})
    with pytest.raises(UserError) as info:
        compose(["parallel=dp2"], extra_dirs=[folder])
    assert "parallel.bogus" in info.value.message() and str(folder / "parallel" / "dp2.yaml") in info.value.message()


@pytest.mark.parametrize("header", ["", "# my recipe\n# @package _global_\n"])
def test_a_recipe_without_the_package_header_says_so(tmp_path, header):
    folder = _user_folder(
        tmp_path, {"recipe/mine.yaml": header + "defaults:\n  - override /model: gpt-tiny\nrecipe: mine\ntrain:\n  steps: 3\n"}
    )
    with pytest.raises(UserError) as info:
        compose(["recipe=mine"], extra_dirs=[folder])
    message = info.value.message()
    assert str(folder / "recipe" / "mine.yaml") in message and "must start with the line `# @package _global_`" in message
