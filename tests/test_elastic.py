"""Elastic training, drilled on one machine: two launchers ("nodes") on loopback train dp2;
one is killed for good after a checkpoint, and the other goes on alone at dp1 from that
checkpoint, with the losses of an uninterrupted run and no sample skipped or repeated."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import pick_free_port

from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.launch.slurm import slurm_script
from llmforge.launch.torchrun import torchrun_args
from llmforge.observe.metrics import read_metrics
from llmforge.plan import RunPlan
from llmforge.train.components import RankInfo
from llmforge.train.run import run

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_interval=1",
    "checkpoint.interval=2",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=2",
]
ELASTIC = ["parallel.dp=auto", "cluster.nodes=2", "cluster.min_nodes=1", "cluster.devices_per_node=1", "cluster.max_restarts=1"]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def drill(tmp_path_factory, small_data):
    tmp = tmp_path_factory.mktemp("elastic")
    reference = tmp / "reference"
    run(RunPlan.build(compose([*TINY, *small_data, f"run.dir={reference}"])), rank=RankInfo())
    port = pick_free_port()
    nodes = tmp / "nodes"
    # short rendezvous waits: the first agent waits 6 s for the second (which starts a Python process
    # and plans on a busy 2-core machine meanwhile), the survivor goes on 6 s after it is alone, and a
    # silent agent is dropped after 3 s
    args = [
        *TINY,
        *small_data,
        *ELASTIC,
        "cluster.elastic_wait_s=6",
        "cluster.timeout_s=60",
        f"cluster.rdzv_endpoint=127.0.0.1:{port}",
        f"run.dir={nodes}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"}
    command = [sys.executable, "-m", "llmforge", "pretrain", *args]
    # the first launcher hosts the rendezvous store (the job's single point of failure): the second is the one lost
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not _listening(port) and time.time() < deadline and first.poll() is None:
        time.sleep(0.1)
    lost = subprocess.Popen(command, env={**env, "LLMFORGE_NODE_LOSS": "3"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_lost = lost.communicate(timeout=300)[0]
    out_first = first.communicate(timeout=300)[0]
    return reference, nodes, first.returncode, lost.returncode, out_first, out_lost


@pytest.mark.slow
def test_the_survivor_finishes_alone_with_an_uninterrupted_runs_numbers(drill):
    reference, nodes, code, lost_code, output, lost_output = drill
    assert lost_code == -9, lost_output[-3000:]
    assert code == 0, output[-6000:]
    text = output.replace("\n", "")
    assert (
        "restart 1 of 1: the world changed from 2 to 1 ranks (2 -> 1 of 2 nodes): layout dp2 -> single, "
        f"2 -> 4 microbatches per data-parallel rank, global batch 8 sequences as before; resuming from {nodes}/checkpoints/step_2"
    ) in text
    got, ref = read_metrics(nodes / "metrics.jsonl"), {r["step"]: r["loss"] for r in read_metrics(reference / "metrics.jsonl")}
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # step 3 trained again once (at dp1), logged once
    for record in got:
        assert record["loss"] == pytest.approx(ref[record["step"]], rel=1e-5)
    # no sample skipped or repeated: the global position ends where the uninterrupted run's does
    state = [json.loads((d / "checkpoints" / "step_6" / "train_state.json").read_text()) for d in (nodes, reference)]
    assert [s["sampler"]["position"] for s in state] == [6 * 8, 6 * 8]
    saved = json.loads((nodes / "checkpoints" / "step_6" / "plan.json").read_text())["derived"]
    assert (saved["world_size"], saved["dp"], saved["microbatches"]) == (1, 1, 4)


def test_an_elastic_plan_launches_torchrun_on_a_node_range():
    plan = RunPlan.build(compose([*ELASTIC, "cluster.elastic_wait_s=12", "cluster.rdzv_endpoint=head:29500", "train.global_batch_size=8"]))
    args = torchrun_args(plan)
    assert "--nnodes=1:2" in args and "--max-restarts=1" in args
    assert "--rdzv-conf=last_call_timeout=12,keep_alive_interval=2,keep_alive_max_attempt=3" in args
    script = slurm_script(plan, plan_path=Path("/runs/x/plan.json"), resume_from=None)
    assert "#SBATCH --nodes=1-2" in script and "#SBATCH --no-kill" in script and "srun --no-kill --kill-on-bad-exit=0" in script
    assert "--nnodes=1:2" in script


def test_each_world_of_the_range_gets_its_own_layout_and_the_same_batch():
    plan = RunPlan.build(
        compose(
            [
                "parallel.dp=auto",
                "cluster.nodes=4",
                "cluster.min_nodes=2",
                "cluster.devices_per_node=2",
                "cluster.max_restarts=3",
                "parallel.tp=2",
                "train.micro_batch_size=2",
                "train.global_batch_size=24",
            ]
        )
    )
    assert (plan.world_size, plan.dp, plan.microbatches) == (8, 4, 3)
    smaller = plan.at_world(4)
    assert (smaller.world_size, smaller.dp, smaller.microbatches, str(smaller.layout)) == (4, 2, 6, "dp2xtp2")
    assert smaller.tokens_per_step == plan.tokens_per_step
    with pytest.raises(UserError, match="torchrun started 2 ranks"):
        plan.at_world(2)  # one node: below cluster.min_nodes


def problems_of(*overrides: str) -> str:
    with pytest.raises(UserError) as info:
        RunPlan.build(compose(list(overrides)))
    return info.value.message()


def test_elastic_plans_that_cannot_run_on_every_node_count_are_refused():
    text = problems_of("cluster.nodes=2", "cluster.min_nodes=1")
    assert "cluster.devices_per_node" in text and "parallel.dp=auto" in text and "cluster.max_restarts=3" in text
    text = problems_of(
        "parallel.dp=auto",
        "cluster.nodes=3",
        "cluster.min_nodes=1",
        "cluster.devices_per_node=2",
        "cluster.max_restarts=1",
        "train.micro_batch_size=2",
        "train.global_batch_size=12",
    )
    assert "train.global_batch_size = 12" in text and "with 2 node(s) of the elastic range 1-3" in text and "a multiple of 24" in text
    # the model-parallel part must fit the smallest world
    text = problems_of(
        "parallel.dp=auto",
        "cluster.nodes=4",
        "cluster.min_nodes=1",
        "cluster.devices_per_node=2",
        "cluster.max_restarts=1",
        "parallel.pp=4",
        "train.global_batch_size=64",
        "train.micro_batch_size=1",
    )
    assert "with 1 node(s) of the elastic range 1-4: does not divide the world size 2" in text
    assert "cluster.min_nodes = 3" in problems_of("cluster.nodes=2", "cluster.min_nodes=3")


def test_an_elastic_plan_must_fit_its_smallest_world_in_memory():
    """On fewer nodes ZeRO shards over fewer ranks: llama-8b fits 4 H100s, not the 1 of min_nodes=1."""
    import io

    from rich.console import Console

    from llmforge.launch.checks import preflight

    plan = RunPlan.build(
        compose(
            [
                "recipe=llama-8b",
                "parallel=fsdp",
                "parallel.dp=auto",
                "parallel.recompute=full",
                "cluster.nodes=4",
                "cluster.min_nodes=1",
                "cluster.devices_per_node=1",
                "cluster.max_restarts=2",
                "cluster.rdzv_endpoint=h:1",
                "train.global_batch_size=504",
            ]
        )
    )
    quiet = Console(file=io.StringIO())
    with pytest.raises(UserError, match="on 1 node\\(s\\) the layout is single, which does not fit"):
        preflight(plan, force=False, resume=False, console=quiet)
    preflight(plan, force=True, resume=False, console=quiet)
