"""Resume across processes (gloo on CPU): bit-identical on dp2 and tp2xpp2, and
resharding (tp2xpp2 -> dp4 -> one process, ZeRO-3 -> ZeRO-1, HSDP <-> ZeRO-3) with the same samples.

One torchrun per world size runs every phase in a single started process group
(this file is also the worker: ``python -m torch.distributed.run ... THIS SPEC OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_interval=1",
    "checkpoint.interval=3",
    "checkpoint.keep=10",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=2",
]


def _record_ids(store: dict):
    """Patch the sampler so every rank records (global position, dp rank) -> sequence ids
    of the training stream (validation reads the held-out one)."""
    from llmforge.data.sampler import BatchSampler

    original = BatchSampler.next_batch

    def next_batch(sampler, *, dp_rank: int, dp_size: int):
        position = sampler.position
        out = original(sampler, dp_rank=dp_rank, dp_size=dp_size)
        if sampler.split == "train":
            store[(position, dp_rank)] = sampler.last_sequence_ids.tolist()
        return out

    BatchSampler.next_batch = next_batch


def _phase(spec: dict, *, base: list, ids: dict):
    """Train one phase (fresh or resumed) on this rank; return (plan, resumed-from)."""
    import torch.distributed as dist

    from llmforge.checkpoint.resume import plan_for_resume
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan
    from llmforge.testing.harness import rank_info
    from llmforge.train.run import run

    if spec.get("resume"):
        plan, path = plan_for_resume([f"ckpt={spec['resume']}", f"run.dir={spec['run_dir']}", *spec["overrides"]])
    else:
        plan, path = RunPlan.build(compose([*base, *spec["overrides"], f"run.dir={spec['run_dir']}"])), None
    ids.clear()
    run(plan, rank=rank_info(plan, device=__import__("torch").device("cpu")), resume_from=path)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(ids))
    merged = {k: v for part in gathered for k, v in part.items()}
    return [row for key in sorted(merged) for row in merged[key]]


def worker(spec_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from llmforge.train.run import prepare_data

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    from llmforge.launch.guard import install_from_env

    install_from_env(__import__("torch").device("cpu"))
    ids: dict = {}
    _record_ids(ids)
    results = {}
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    if dist.get_rank() == 0:
        prepare_data(RunPlan.build(compose(spec["base"])), console=None)
    dist.barrier()
    for name, phase in spec["phases"].items():
        results[name] = _phase(phase, base=spec["base"], ids=ids)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch(tmp_path: Path, *, nproc: int, base: list, phases: dict) -> dict:
    spec, out = tmp_path / f"spec{nproc}.json", tmp_path / f"out{nproc}.json"
    spec.write_text(json.dumps({"base": base, "phases": phases}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__, str(spec), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def losses(run_dir: Path) -> dict:
    from llmforge.observe.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


@pytest.fixture(scope="module")
def single(tmp_path_factory, small_data):
    """The uninterrupted single-process run every layout is compared with."""
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan
    from llmforge.train.components import RankInfo
    from llmforge.train.run import run

    ids: dict = {}
    mp = pytest.MonkeyPatch()
    from llmforge.data.sampler import BatchSampler

    mp.setattr(BatchSampler, "next_batch", BatchSampler.next_batch)
    _record_ids(ids)
    run_dir = tmp_path_factory.mktemp("single")
    run(RunPlan.build(compose([*TINY, *small_data, f"run.dir={run_dir}"])), rank=RankInfo())
    mp.undo()
    return run_dir, [row for key in sorted(ids) for row in ids[key]]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, small_data):
    """A dp2 run saving at step 3, and a dp2 resume from it (2 ranks)."""
    tmp_path = tmp_path_factory.mktemp("dp2")
    a = tmp_path / "dp2"
    phases = {
        "dp2": {"overrides": ["parallel=dp2"], "run_dir": str(a)},
        "dp2_resumed": {"resume": str(a / "checkpoints/step_3"), "overrides": [], "run_dir": str(tmp_path / "r1")},
    }
    launch(tmp_path, nproc=2, base=[*TINY, *small_data], phases=phases)
    return a, tmp_path / "r1"


@pytest.mark.slow
def test_four_ranks_bit_identical_and_reshard(tmp_path, small_data, single, dp2):

    ref_dir, ref_ids = single
    base = [*TINY, *small_data]
    a, z, h = tmp_path / "tp2pp2", tmp_path / "fsdp", tmp_path / "hsdp"
    phases = {
        "tp2pp2": {"overrides": ["parallel=tp2pp2"], "run_dir": str(a)},
        "tp2pp2_resumed": {"resume": str(a / "checkpoints/step_3"), "overrides": [], "run_dir": str(tmp_path / "r1")},
        "dp4_from_tp2pp2": {"resume": str(a / "checkpoints/step_3"), "overrides": ["parallel=dp4"], "run_dir": str(tmp_path / "r2")},
        "zero3": {"overrides": ["parallel=fsdp", "cluster.devices_per_node=4", "checkpoint.async=true"], "run_dir": str(z)},
        "zero1_from_zero3": {"resume": str(z / "checkpoints/step_3"), "overrides": ["parallel=zero1"], "run_dir": str(tmp_path / "r3")},
        "dp4_from_dp2": {"resume": str(dp2[0] / "checkpoints/step_3"), "overrides": ["parallel=dp4"], "run_dir": str(tmp_path / "r4")},
        "hsdp": {"overrides": ["parallel=fsdp", "cluster.devices_per_node=4", "parallel.dp_replicate=2"], "run_dir": str(h)},
        "zero3_from_hsdp": {
            "resume": str(h / "checkpoints/step_3"),
            "overrides": ["parallel.dp_replicate=1"],
            "run_dir": str(tmp_path / "r5"),
        },
        "hsdp_from_zero3": {
            "resume": str(z / "checkpoints/step_3"),
            "overrides": ["parallel.dp_replicate=2"],
            "run_dir": str(tmp_path / "r6"),
        },
    }
    ids = launch(tmp_path, nproc=4, base=base, phases=phases)
    ref = losses(ref_dir)
    full, resumed = losses(a), losses(tmp_path / "r1")
    assert [resumed[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]  # bit-identical
    for name, run_dir in (
        ("dp4_from_tp2pp2", "r2"),
        ("zero1_from_zero3", "r3"),
        ("dp4_from_dp2", "r4"),
        ("zero3_from_hsdp", "r5"),
        ("hsdp_from_zero3", "r6"),
    ):
        got = losses(tmp_path / run_dir)
        assert sorted(got) == [4, 5, 6]
        assert all(abs(got[s] - ref[s]) < 1e-4 for s in got), (name, got, ref)
    assert ids["tp2pp2"] == ref_ids and ids["zero3"] == ref_ids and ids["hsdp"] == ref_ids
    assert all(abs(losses(h)[s] - ref[s]) < 1e-4 for s in range(1, 7))
    for name in ("tp2pp2_resumed", "dp4_from_tp2pp2", "zero1_from_zero3", "dp4_from_dp2", "zero3_from_hsdp", "hsdp_from_zero3"):
        assert ids[name] == ref_ids[3 * 8 :], name  # no sample skipped or repeated


@pytest.mark.slow
def test_two_ranks_bit_identical_and_resume_in_one_process(tmp_path, single, dp2):
    from llmforge.checkpoint.resume import plan_for_resume
    from llmforge.train.components import RankInfo
    from llmforge.train.run import run

    ref_dir, _ = single
    a, resumed_dir = dp2
    full, resumed = losses(a), losses(resumed_dir)
    assert [resumed[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]  # bit-identical
    plan, path = plan_for_resume([f"ckpt={a}/checkpoints/step_3", f"run.dir={tmp_path / 'one'}", "parallel=single"])
    run(plan, rank=RankInfo(), resume_from=path)
    got, ref = losses(tmp_path / "one"), losses(ref_dir)
    assert all(abs(got[s] - ref[s]) < 1e-4 for s in (4, 5, 6)), (got, ref)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(sys.argv[1], sys.argv[2])
