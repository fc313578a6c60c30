"""Every fix a refused plan suggests is accepted when pasted: over a table of refused plans,
each alternative of the problem's fix (``set a=1 or b=2``) is added to the overrides and the
plan is checked again; neither the problem's key nor a pasted key may be refused again (the
plan may still need other fixes). No torch, no run."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest

from llmforge.config.compose import compose
from llmforge.config.qat_rules import fitting_group_size
from llmforge.errors import Problem, UserError
from llmforge.launch.platform import platform_problems
from llmforge.plan import RunPlan, config_from_dict, plain

TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.steps=4",
]
ELASTIC = ["parallel.dp=auto", "cluster.devices_per_node=1", "cluster.max_restarts=3"]
SKY = ["cluster.launcher=skypilot", "cluster.accelerator=h100-80gb", "cluster.image=example/llmforge:1"]
SKY_RUNS = [*SKY, "cluster.skypilot.runs_bucket=s3://bucket/runs", "run.dir=/runs/tiny"]
K8S = ["cluster.launcher=kubernetes", "cluster.accelerator=h100-80gb", "cluster.image=example/llmforge:1"]
K8S_RUNS = [*K8S, "cluster.kubernetes.runs_claim=runs", "run.dir=/runs/tiny"]

#: (refused overrides, the key refused): each row's problem has a fix with a value to paste.
REFUSED = [
    (["cluster.nodes=2", "cluster.devices_per_node=1"], "parallel.dp"),
    (["cluster.nodes=2", "cluster.devices_per_node=3", "parallel.tp=2"], "parallel.dp"),
    (["cluster.nodes=3", "cluster.devices_per_node=3", "parallel.tp=2"], "parallel.dp"),
    (["cluster.nodes=1", "cluster.devices_per_node=2", "parallel.dp=auto", "train.global_batch_size=6"], "train.global_batch_size"),
    ([*ELASTIC, "cluster.nodes=3", "train.global_batch_size=8", "train.steps=4"], "train.global_batch_size"),
    ([*ELASTIC, "cluster.nodes=3", "cluster.min_nodes=2", "train.global_batch_size=7"], "train.global_batch_size"),
    ([*ELASTIC, "cluster.nodes=4", "cluster.min_nodes=2", "train.global_batch_size=12"], "train.global_batch_size"),
    (["model.num_layers=4", "parallel.pp=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=2"], "train.global_batch_size"),
    (
        [
            "model.num_layers=4",
            "parallel.pp=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_virtual_stages=2",
            "train.global_batch_size=6",
        ],
        "train.global_batch_size",
    ),
    (["precision.qat=int4", "model.hidden_size=40", "model.ffn_hidden_size=80"], "precision.qat_group_size"),
    (["precision.qat=int4", "precision.qat_group_size=64", "model.hidden_size=48", "model.ffn_hidden_size=96"], "precision.qat_group_size"),
    (["precision.qat=int4", "precision.qat_start_step=9"], "precision.qat_start_step"),
    (["train.profile=7-9"], "train.profile"),
    (["model.sliding_window_every=2"], "model.sliding_window_every"),
    (["model.num_layers=4", "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_schedule"),
    (["model.num_layers=4", "parallel.pp=2", "parallel.pp_virtual_stages=2"], "parallel.pp_virtual_stages"),
    (["model.num_layers=4", "parallel.pp=2", "parallel.cp=2", "cluster.devices_per_node=4", "parallel.dp=1"], "parallel.cp"),
    ([*K8S_RUNS, "cluster.kubernetes.runs_mount=runs"], "cluster.kubernetes.runs_mount"),
    ([*K8S_RUNS, "run.dir=/elsewhere/tiny"], "run.dir"),
    ([*K8S], "cluster.kubernetes.runs_claim"),
    ([o for o in K8S_RUNS if not o.startswith("cluster.image")], "cluster.image"),
    ([o for o in SKY_RUNS if not o.startswith("cluster.image")], "cluster.image"),
    ([*SKY_RUNS, "cluster.skypilot.runs_mount=runs/"], "cluster.skypilot.runs_mount"),
    ([*SKY], "cluster.skypilot.runs_bucket"),
    ([*SKY_RUNS, "cluster.nodes=2", "cluster.devices_per_node=1", "parallel.dp=auto"], "data.cache_dir"),
    ([*SKY, "cluster.nodes=2", "cluster.devices_per_node=1", "parallel.dp=auto"], "data.cache_dir"),
    ([*K8S_RUNS, "cluster.nodes=2", "cluster.devices_per_node=1", "parallel.dp=auto"], "data.cache_dir"),
    (
        [*SKY_RUNS, "cluster.skypilot.data_bucket=s3://bucket/data", "cluster.nodes=2", "cluster.devices_per_node=1", "parallel.dp=auto"],
        "data.cache_dir",
    ),
]

#: ``key=value`` in a fix: quoted whole ('a.b=x y') or up to a space, comma, semicolon or ')'.
PASTED = re.compile(r"'([a-z_]+(?:\.[a-z_]+)+=[^']*)'|(?<![\w.])([a-z_]+(?:\.[a-z_]+)+=[^\s,;)]+)")


@functools.cache
def tiny_recipe() -> dict:
    """The tiny recipe composed once (Hydra); each case applies its overrides on top of it."""
    return plain(dataclasses.asdict(compose(["recipe=tiny"])))


def refused(overrides: list[str]) -> list[Problem]:
    """What the plan refuses: RunPlan.build's problems, then a platform launcher's."""
    config = config_from_dict(tiny_recipe(), [*TINY, *overrides])
    try:
        plan = RunPlan.build(config)
    except UserError as error:
        return error.problems
    return platform_problems(plan) if config.cluster.launcher in ("kubernetes", "skypilot") else []


def alternatives(fix: str) -> list[list[str]]:
    """The fix's alternatives (split at ' or '), each as the overrides it pastes together."""
    found = []
    for part in re.split(r",? or (?=\S+=|'|set )", fix):
        pasted = [quoted or plain for quoted, plain in PASTED.findall(part)]
        if pasted:
            found.append(pasted)
    return found


@pytest.mark.parametrize(("overrides", "key"), REFUSED, ids=[f"{i}-{key}" for i, (_, key) in enumerate(REFUSED)])
def test_a_pasted_fix_is_accepted(overrides, key):
    problems = [p for p in refused(overrides) if p.key == key]
    assert problems, f"{key} is not refused: {[p.render() for p in refused(overrides)]}"
    for problem in problems:
        options = alternatives(problem.fix)
        assert options, f"no value to paste in: {problem.render()}"
        for pasted in options:
            keys = {key, *(p.split("=", 1)[0] for p in pasted)}
            again = [p.render() for p in refused([*overrides, *pasted]) if p.key in keys]
            assert not again, f"pasting {pasted} from {problem.render()!r} is refused again: {again}"


def test_the_alternatives_of_a_fix_are_read_as_pasted():
    fix = "set parallel.dp=auto or cluster.nodes=1 cluster.devices_per_node=2, or 'cluster.skypilot.setup=pip install x' (first)"
    assert alternatives(fix) == [
        ["parallel.dp=auto"],
        ["cluster.nodes=1", "cluster.devices_per_node=2"],
        ["cluster.skypilot.setup=pip install x"],
    ]


@pytest.mark.parametrize(("size", "widths", "best"), [(32, (40, 80), 20), (64, (48, 96), 48), (32, (41, 80), 20), (32, (4, 4), 4)])
def test_the_group_size_hint_divides_a_width(size, widths, best):
    assert fitting_group_size(size, widths=widths) == best
