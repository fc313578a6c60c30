"""Multi-node launch, rehearsed on one machine: two `llmforge pretrain` launchers (one per
"node") meet at a c10d rendezvous on loopback and train dp2 as one job, after the pre-flight
network check (against a profile that claims a modest link between the nodes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from llmforge.cli import app


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_node_launch_trains_like_one_process(tmp_path, small_data, free_port, cpu_profile_claiming):
    common = [*small_data, "train.steps=3", "train.log_interval=1", "logging=quiet", "train.global_batch_size=8"]
    single = tmp_path / "single"
    assert CliRunner().invoke(app, ["pretrain", *common, f"run.dir={single}"]).exit_code == 0

    nodes = tmp_path / "nodes"
    args = [
        *common,
        "parallel=dp2",
        "cluster.nodes=2",
        "cluster.devices_per_node=1",
        f"cluster.rdzv_endpoint=127.0.0.1:{free_port}",
        f"run.dir={nodes}",
        "cluster.network_check=true",
    ]
    env = {**os.environ, "LLMFORGE_CONFIG_PATH": str(cpu_profile_claiming(0.001))}
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "llmforge", "pretrain", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs
    assert any("network check: all-reduce across 2 nodes" in out for out in outputs)
    assert _losses(nodes / "metrics.jsonl") == pytest.approx(_losses(single / "metrics.jsonl"), rel=1e-5)
    assert (nodes / "checkpoints" / "step_3").is_dir()
