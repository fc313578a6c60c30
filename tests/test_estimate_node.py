"""Host memory per node: every rank of a node added up, checked before launch and in the search (no torch)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.estimate import shape as shape_module
from llmforge.estimate.core import estimate, estimate_plan
from llmforge.estimate.node import CHECKPOINT_BYTES, RANK_BASE_BYTES, largest_parameter
from llmforge.estimate.report import as_dict, summary_text
from llmforge.estimate.search import search
from llmforge.estimate.shape import Job, from_plan
from llmforge.estimate.text import verdict
from llmforge.hardware import GIB, get_profile
from llmforge.layout import Layout

GPT_1B_4_RANKS = ["recipe=gpt-1b", "cluster=cpu", "parallel=fsdp", "parallel.dp=4", "parallel.recompute=full", "train.micro_batch_size=1"]


@pytest.fixture
def machine_24gib(monkeypatch, tmp_path):
    """A 24 GiB machine with no calibrated CPU profile of its own."""
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(shape_module, "machine_memory", lambda: 24 * GIB)


def _plan(*overrides):
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    return RunPlan.build(compose(list(overrides)))


def test_cpu_ranks_on_one_machine_add_up_and_do_not_fit(machine_24gib):
    est = estimate_plan(_plan(*GPT_1B_4_RANKS))
    node = est.node
    assert est.fits_device  # each rank alone fits the profile's memory...
    assert node.ranks == 4 and node.capacity == 24 * GIB
    assert node.per_rank == pytest.approx(est.worst.total)  # a CPU rank's footprint is host memory
    assert node.total == pytest.approx(4 * est.worst.total) and 26 * GIB < node.total < 31 * GIB
    assert not node.fits and not est.fits  # ...but four of them do not fit the machine
    for text in (verdict(est), summary_text(est)):
        assert "fits," not in text and "does not fit the node" in text
    data = as_dict(est)
    assert data["fits"] is False and data["node"]["fits"] is False
    assert data["node"]["host_bytes"] == pytest.approx(node.total) and data["node"]["host_capacity_bytes"] == 24 * GIB


def test_the_same_ranks_fit_a_larger_machine(monkeypatch, machine_24gib):
    monkeypatch.setattr(shape_module, "machine_memory", lambda: 32 * GIB)
    est = estimate_plan(_plan(*GPT_1B_4_RANKS))
    assert est.node.capacity == 32 * GIB and est.node.fits and est.fits
    assert verdict(est).startswith("fits,") and "node host memory" in verdict(est)


def test_a_profile_host_memory_is_the_node_capacity(tmp_path, machine_24gib):
    profile = tmp_path / "cpu-big.yaml"
    builtin = get_profile("cpu")
    profile.write_text(
        f"name: cpu\nmemory_gib: 16\npeak_tflops: {{fp32: 0.1, bf16: 0.05, fp16: 0.02}}\nmemory_bandwidth_gbs: 20\n"
        f"intra_node_gbs: 5\ninter_node_gbs: 1.25\ndevices_per_node: {builtin.devices_per_node}\nhost_memory_gib: 64\n"
    )
    est = estimate_plan(_plan(*GPT_1B_4_RANKS, f"cluster.accelerator={profile}"))
    assert est.node.capacity == 64 * GIB and est.fits


def test_pretrain_refuses_before_launch_with_the_node_sum(machine_24gib, tmp_path):
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["pretrain", *GPT_1B_4_RANKS, f"run.dir={run_dir}", "--dry-run"])
    assert result.exit_code == 2, result.output
    total = estimate_plan(_plan(*GPT_1B_4_RANKS)).node.total
    assert f"{total / GIB:,.2f} GiB of host memory together" in result.output
    assert "24.00 GiB" in result.output and "a node holds at most 3 ranks" in result.output and "--force" in result.output
    assert "Traceback" not in result.output and not run_dir.exists()
    forced = CliRunner().invoke(app, ["pretrain", *GPT_1B_4_RANKS, f"run.dir={run_dir}", "--dry-run", "--force"])
    assert forced.exit_code == 0, forced.output


def test_estimate_json_and_table_show_the_node(machine_24gib):
    result = CliRunner().invoke(app, ["estimate", *GPT_1B_4_RANKS, "--json"])
    node = json.loads(result.stdout)["node"]
    assert node["ranks"] == 4 and node["host_capacity_bytes"] == 24 * GIB and not node["fits"]
    table = CliRunner().invoke(app, ["estimate", *GPT_1B_4_RANKS])
    assert "host memory / node" in table.output and "Verdict: does not fit the node" in table.output


def test_search_on_cpu_never_proposes_what_the_machine_cannot_hold(machine_24gib):
    plan = _plan("recipe=gpt-7b", "cluster=cpu")
    shape, _, job = from_plan(plan)
    result = search(shape, job, world=1, top=3)
    assert not result.ranked  # 7B on one 24 GiB machine: nothing
    # no proposal puts more ranks on this machine than its memory holds (many nodes of it may)
    assert not any("8 x cpu" in s or "cluster.nodes=1 " in s for s in result.suggestions), result.suggestions
    shape, _, job = from_plan(_plan("recipe=gpt-1b", "cluster=cpu"))
    small = search(shape, job, world=4, top=5)
    assert small.ranked and all(e.node.fits and e.node.total <= 24 * GIB for e in small.ranked)


def test_gpu_ranks_keep_the_process_the_build_buffer_and_staging():
    from llmforge.estimate.inventory import inventory

    shape, layout, job = from_plan(_plan("recipe=llama-8b"))
    est = estimate(shape, layout, job)
    items = est.node.items
    assert items["process"] == RANK_BASE_BYTES
    assert items["build buffer"] == 4 * shape.vocab * shape.hidden == 4 * largest_parameter(shape)  # the embedding, whole, fp32
    assert "checkpoint staging" not in items and est.node.ranks == min(layout.world, job.devices_per_node or layout.world)
    staged = estimate(shape, layout, dataclasses.replace(job, async_checkpoint=True))
    assert staged.node.items["checkpoint staging"] == CHECKPOINT_BYTES * inventory(shape, layout).stages[staged.worst.stage].shard


def test_gpu_search_proposes_only_layouts_whose_nodes_fit():
    """With checkpoint staging (12 bytes per parameter of a rank's shard) and a tight host memory,
    the layouts that shard less are left out: every proposal's node fits."""
    from llmforge.estimate.search import search as run

    shape, _, job = from_plan(_plan("recipe=llama-8b", "cluster=h100-node"))
    staged = dataclasses.replace(job, async_checkpoint=True, global_batch=32)
    free = run(shape, dataclasses.replace(staged, host_memory=10**15), world=8, top=50)
    tight = 8 * (RANK_BASE_BYTES + 4 * largest_parameter(shape) + 2 * GIB) + 8 * CHECKPOINT_BYTES * 8e9 / 8
    bounded = run(shape, dataclasses.replace(staged, host_memory=int(tight)), world=8, top=50)
    assert bounded.fitting < free.fitting  # some layouts fit their devices but not the node
    assert bounded.ranked and all(e.node.fits for e in bounded.ranked)


def test_offloaded_states_count_on_the_node():
    shape, _, job = from_plan(_plan("recipe=llama-8b", "cluster=h100-node"))
    layout = Layout(dp=8, zero=3, recompute="full", micro_batch_size=1, offload="states")
    est = estimate(shape, layout, dataclasses.replace(job, global_batch=8))
    assert est.node.items["offloaded"] == pytest.approx(est.host.states_bytes + est.host.activations_bytes)
    assert est.node.total == pytest.approx(8 * est.node.per_rank)


def test_job_defaults_use_the_profile_host_memory():
    job = Job(global_batch=8, param_dtype="bf16", reduce_dtype="fp32", profile=get_profile("h100-80gb"))
    shape = from_plan(_plan("recipe=gpt-1b"))[0]
    est = estimate(shape, Layout(dp=8, zero=3), job)
    assert est.node.capacity == get_profile("h100-80gb").host_memory_bytes


def test_when_only_the_node_is_short_the_search_says_so(machine_24gib):
    shape, _, job = from_plan(_plan("recipe=gpt-1b", "cluster=cpu"))
    result = search(shape, job, world=8, top=3)
    assert not result.ranked
    leanest = result.suggestions[0]
    assert "which its device holds" in leanest and "of host memory together" in leanest and "more than it has" not in leanest
    assert not any(s.startswith("A larger device") for s in result.suggestions)


def test_ranks_split_over_nodes_count_per_node(machine_24gib):
    one = estimate_plan(_plan(*GPT_1B_4_RANKS))
    two = estimate_plan(_plan(*GPT_1B_4_RANKS, "cluster.nodes=2"))
    assert two.node.ranks == 2 and two.node.total == pytest.approx(one.node.total / 2) and two.fits
