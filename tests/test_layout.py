"""The plan's layout: its name, where pipeline chunks run, and one set of rules for
plan, estimate, search and pretrain."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.estimate.params import stage_layers
from llmforge.estimate.search import plan_config
from llmforge.estimate.shape import shape_from_config
from llmforge.layout import Layout, chunk_rank, stage_ids
from llmforge.plan import RunPlan


@pytest.mark.parametrize(
    "layout,name",
    [
        (Layout(), "single"),
        (Layout(dp=2, tp=2), "dp2xtp2"),
        (Layout(dp=8, dp_replicate=2, tp=2), "hsdp2x4xtp2"),
        (Layout(pp=4, cp=2, ep=2), "pp4xcp2xep2"),
    ],
)
def test_a_layout_is_named_by_its_degrees(layout, name):
    assert str(layout) == name


def test_the_plan_owns_its_layout_and_its_degrees_read_from_it():
    plan = RunPlan.build(compose(["recipe=llama-8b", "parallel=hsdp", "cluster=h100-node", "cluster.nodes=4"]))
    assert plan.layout == Layout.from_config(plan.config, dp=32)
    assert (plan.dp, plan.layout.tp, plan.layout.pp, plan.layout.dp_replicate, plan.layout.dp_shard) == (32, 1, 1, 4, 8)
    assert f"{plan.layout}" == "hsdp4x8"


@pytest.mark.parametrize(
    "pp,virtual,schedule,expected",
    [
        (4, 1, "1f1b", [[0], [1], [2], [3]]),
        (2, 3, "interleaved_1f1b", [[0, 2, 4], [1, 3, 5]]),
        (4, 2, "zbv", [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_every_chunk_runs_on_exactly_one_pipeline_rank(pp, virtual, schedule, expected):
    ids = [stage_ids(pp_rank=r, pp=pp, virtual=virtual, schedule=schedule) for r in range(pp)]
    assert ids == expected
    assert sorted(c for row in ids for c in row) == list(range(pp * virtual))
    assert all(chunk_rank(c, pp=pp, v_shape=schedule == "zbv") == r for r, row in enumerate(ids) for c in row)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)])
def test_the_estimator_places_blocks_where_the_backend_runs_them(schedule, virtual):
    plan = RunPlan.build(
        compose(
            [
                "model.num_layers=8",
                "parallel.pp=2",
                f"parallel.pp_schedule={schedule}",
                f"parallel.pp_virtual_stages={virtual}",
                "train.global_batch_size=16",
            ]
        )
    )
    per_chunk = plan.layers_per_stage[0]
    held = stage_layers(shape_from_config(plan.config.model), 2, virtual, None, plan.layout.v_shape)
    for rank in range(2):
        blocks = [b for c in plan.layout.stage_ids(rank) for b in range(c * per_chunk, (c + 1) * per_chunk)]
        assert tuple(sorted(blocks)) == held[rank]


UNSUPPORTED = ["parallel.cp=2", "parallel.pp=2", "model.num_layers=4"]


@pytest.fixture(scope="module")
def refusals():
    runner = CliRunner()
    return {
        cmd: runner.invoke(app, [cmd, *UNSUPPORTED, *(["--dry-run"] if cmd == "pretrain" else [])])
        for cmd in ("plan", "estimate", "pretrain")
    }


@pytest.mark.parametrize("command", ["plan", "estimate", "pretrain"])
def test_what_the_backend_cannot_run_is_refused_alike_by_every_command(refusals, command):
    result = refusals[command]
    assert result.exit_code == 2
    assert "parallel.cp = 2: context parallelism is not supported with pipeline parallelism" in result.output
    assert "Fix: set parallel.cp=1 or parallel.pp=1" in result.output and "Traceback" not in result.output
    assert result.output == refusals["plan"].output


def test_the_search_proposes_only_layouts_the_plan_accepts():
    plan = RunPlan.build(compose(["model.num_layers=4", "parallel.dp=4"]))
    with pytest.raises(UserError) as info:
        RunPlan.build(plan_config(plan, Layout(cp=2, pp=2, dp=1, micro_batch_size=1)))
    assert [p.key for p in info.value.problems] == ["parallel.cp"]


def test_the_backend_runs_every_schedule_the_config_names():
    from llmforge.config.schema import SCHEDULES
    from llmforge.parallel.pipeline import SCHEDULES as TORCH_SCHEDULES

    assert tuple(TORCH_SCHEDULES) == SCHEDULES
