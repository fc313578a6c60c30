"""The run's health watch in one process: the loop's progress reports and how a launcher reads
them, when a rank is hung and what the message says, which rank is the straggler, and the
accelerator check that refuses a slowed device before anything is built. The multi-rank drill
(a rank stuck in a collective, a slowed rank, the restart) is tests/test_restart.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmforge.cli import app
from llmforge.config.train_rules import parse_faults
from llmforge.errors import UserError
from llmforge.launch.devicecheck import SLOW_DEVICE_ENV, DeviceSpeed, check_accelerators, device_problem, expected_rates, wanted
from llmforge.processes.dumps import InFlight
from llmforge.processes.hang import HangBounds, behind, hang_message, stale, waiting
from llmforge.processes.nodes import NodeBoard, Notice
from llmforge.processes.progress import Progress, Reporter, progress_path, read_progress
from llmforge.testing.harness import tiny_plan
from llmforge.train.stragglers import slowest

BOUNDS = HangBounds(step_s=0.5, factor=10, floor_s=2, long_s=60)


def at(rank: int, step: int, phase: str, *, age: float, done: int = 3, micro: int = 0) -> Progress:
    return Progress(rank=rank, step=step, steps_done=done, microbatch=micro, phase=phase, pid=1, attempt=0, age_s=age)


def test_a_ranks_reports_are_read_by_its_launcher(tmp_path):
    reporter = Reporter()
    reporter.open(progress_path(tmp_path, 3), attempt=1)
    reporter.mark("data", step=7)
    reporter.mark("backward", microbatch=2)
    reporter.step_done()
    reporter.mark("comm")
    got = read_progress(tmp_path)[3]
    assert (got.step, got.phase, got.steps_done, got.attempt, got.pid) == (7, "comm", 1, 1, os.getpid())
    assert got.age_s < 5
    reporter.mark("forward", step=8, microbatch=1)
    assert read_progress(tmp_path)[3].where() == "step 8, forward (microbatch 1)"
    times = reporter.take_times()
    assert set(times) == {"data", "compute", "comm", "typical_compute"} and all(t >= 0 for t in times.values())
    assert reporter.take_times()["compute"] < times["compute"] + 1  # counted from zero again
    reporter.close()


def test_a_rank_is_hung_past_its_bound_and_the_bound_follows_the_phase():
    assert BOUNDS.bound(at(0, 4, "comm", age=0)) == 5  # 10 x 0.5 s
    assert BOUNDS.bound(at(0, 1, "forward", age=0, done=0)) == 60  # an attempt's first step: compile, warm-up
    for phase in ("start", "checkpoint", "eval"):
        assert BOUNDS.bound(at(0, 4, phase, age=0)) == 60
    assert HangBounds(step_s=0.01, factor=10, floor_s=2, long_s=60).bound(at(0, 4, "comm", age=0)) == 2  # the floor
    progress = {0: at(0, 4, "comm", age=5.5), 1: at(1, 4, "forward", age=6.0), 2: at(2, 4, "checkpoint", age=30)}
    assert stale(progress, BOUNDS) == [0, 1]
    assert behind(progress) == [1]


def test_the_message_names_who_is_behind_where_each_rank_is_and_what_it_waits_in(tmp_path):
    progress = {0: at(0, 4, "comm", age=5.2), 1: at(1, 4, "forward", age=5.3)}
    flights = {0: [InFlight("0", issued=29, completed=28, name="gloo:all_reduce")], 1: [InFlight("0", issued=28, completed=28, name="")]}
    assert waiting(0, flights) == "; waits in gloo:all_reduce #29 of process group 0, which rank 1 has not issued"
    assert waiting(1, flights) == "; no collective under way (newest issued: #28 of process group 0)"
    stacks = [tmp_path / "stack-rank0.txt", tmp_path / "stack-rank1.txt"]
    text = hang_message(hung=[1], progress=progress, bounds=BOUNDS, dest=tmp_path, files=stacks, restarts_left=False)
    assert "hang: rank 1 made no progress for 5.3 s (bound 5 s: cluster.health.hang_factor=10 x the estimated step time 0.5 s)" in text
    assert "behind: rank 1" in text and "rank 0: step 4, comm" in text and "rank 1: step 4, forward (microbatch 0)" in text
    assert str(stacks[1]) in text and "raise cluster.health.hang_floor_s" in text


def test_nodes_see_each_others_ranks_and_hangs_through_the_rendezvous_store(tmp_path):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first, second = (NodeBoard(endpoint=None, run_id="run", store=store, node=name) for name in ("a", "b"))
    first.publish({0: at(0, 4, "comm", age=0.5), 1: at(1, 4, "comm", age=0.5)})
    second.publish({2: at(2, 4, "forward", age=3.0)})
    seen = second.others()
    assert sorted(seen) == [0, 1] and seen[0].where() == "step 4, comm" and seen[0].age_s >= 0.5
    assert sorted(first.others()) == [2]
    assert second.announced() is None
    first.announce(attempt=1, dest=tmp_path / "hangs" / "attempt1")
    assert second.announced() == Notice(attempt=1, dest=tmp_path / "hangs" / "attempt1", node="a")
    assert first.announced() is None  # its own


def test_the_straggler_is_the_rank_with_the_most_compute():
    ranks = [{"data": 0.01, "compute": c, "comm": 0.0, "typical_compute": c} for c in (0.10, 0.11, 0.30, 0.09)]
    s = slowest(ranks, estimate_s=0.1)
    assert (s.rank, round(s.ratio, 3), round(s.record()["straggler_vs_estimate"], 3)) == (2, 3.0, 3.0)  # against 0.10, the others'


def test_one_stalled_step_does_not_make_a_straggler():
    import time

    reporter = Reporter()
    for stall in (0.0, 0.05, 0.0):
        reporter.mark("forward", step=1)
        time.sleep(0.002 + stall)
        reporter.mark("log")
        reporter.step_done()
    times = reporter.take_times()
    assert times["compute"] > 0.05 > times["typical_compute"]


def test_fault_drills_combine_and_a_hang_needs_two_ranks(monkeypatch):
    assert parse_faults("1:1-2:slow,1:4:hang") == [(1, 1, 2, "slow"), (1, 4, 4, "hang")]
    with pytest.raises(ValueError):
        parse_faults("1:2:slow,")
    from llmforge.launch.checks import check_fault

    monkeypatch.setenv("LLMFORGE_FAULT", "0:2:hang")
    console = Console(record=True, width=300)
    check_fault(tiny_plan([]), resume_from=None, here=True, console=console)
    assert "a hang waits for another rank, and this run has one" in console.export_text()


def test_the_device_check_is_on_for_accelerators_and_names_a_slow_device():
    assert wanted(tiny_plan(["cluster.accelerator=h100-80gb"])) and not wanted(tiny_plan([]))
    plan = tiny_plan(["cluster.accelerator=h100-80gb"])
    flops, bandwidth = expected_rates(plan)
    fine = DeviceSpeed(rank=0, place="node a, device cuda:0", matmul_flops=flops, copy_bytes_s=bandwidth)
    slow = DeviceSpeed(rank=9, place="node b, device cuda:1", matmul_flops=0.3 * flops, copy_bytes_s=bandwidth)
    assert device_problem(plan, [fine]) is None
    problem = device_problem(plan, [fine, slow])
    assert problem is not None and "rank 9 (node b, device cuda:1): matmul" in problem.rule and "(0.30x)" in problem.rule
    assert "rank 0 " not in problem.rule and "cluster.health.device_check_proceed=true" in problem.fix


def test_a_slowed_device_is_refused_before_the_model_is_built(monkeypatch, tmp_path, small_data):
    import torch

    checked = tiny_plan(["cluster.health.device_check=true", "cluster.health.device_min_fraction=0.05"])
    check_accelerators(checked, device=torch.device("cpu"), console=Console(quiet=True))
    monkeypatch.setenv(SLOW_DEVICE_ENV, "0")
    with pytest.raises(UserError):
        check_accelerators(checked, device=torch.device("cpu"), console=Console())
    run_dir = tmp_path / "run"
    args = ["pretrain", "train.steps=1", "logging.wandb.mode=disabled", "logging.console=false", *small_data, f"run.dir={run_dir}"]
    result = CliRunner().invoke(app, [*args, "cluster.health.device_check=true", "cluster.health.device_min_fraction=0.05"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "rank 0 (node " in " ".join(result.output.split()) and "device_check_proceed=true" in " ".join(result.output.split())
    assert not Path(run_dir).exists()  # refused before the run folder, the data or the model
