"""Checkpoints in object storage, against a real S3-compatible server (moto's) on localhost:
save and resume with the same losses, resume under another layout (dp2, gloo), rotation,
a save killed midway, and the messages of what a user can get wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import pick_free_port

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from llmforge.checkpoint import objstore, store  # noqa: E402
from llmforge.checkpoint.resume import plan_for_resume  # noqa: E402
from llmforge.config.compose import compose  # noqa: E402
from llmforge.errors import UserError  # noqa: E402
from llmforge.observe.metrics import read_metrics  # noqa: E402
from llmforge.plan import RunPlan  # noqa: E402
from llmforge.train.components import RankInfo  # noqa: E402
from llmforge.train.run import run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.log_interval=1",
    "checkpoint.interval=2",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=2",
]
#: A save killed midway: the process SIGKILLs itself right before the manifest of step 4
#: is written, when every shard, the plan, the train state and the RNG states are stored.
KILL_AT_STEP_4 = """
import os, signal, sys
from llmforge.checkpoint import objstore
write = objstore.write_manifest
def killed(prefix, *, step):
    if step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return write(prefix, step=step)
objstore.write_manifest = killed
sys.argv = ["llmforge", *sys.argv[1:]]
from llmforge.cli import main
main()
"""


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free local port with one bucket, and the environment that
    points boto at it (this process and the ones it starts); stopped afterwards."""
    port = pick_free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().makedirs("bucket", exist_ok=True)  # moto keeps one store per process: another module may have made it
    yield env
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


@pytest.fixture(scope="module")
def reference(s3, small_data, tmp_path_factory):
    """An uninterrupted 6-step run saving every 2 steps to s3://bucket/run in the background, keeping 2."""
    run_dir = tmp_path_factory.mktemp("reference")
    plan = RunPlan.build(
        compose([*TINY, *small_data, f"run.dir={run_dir}", "checkpoint.dir=s3://bucket/run", "checkpoint.keep=2", "checkpoint.async=true"])
    )
    run(plan, rank=RankInfo())
    return run_dir, losses(run_dir)


def _cli(args, *, env, script=None, timeout=300):
    command = [sys.executable, "-c", script] if script else [sys.executable, "-m", "llmforge"]
    full_env = {k: v for k, v in {**os.environ, **env, "PYTHONPATH": str(REPO)}.items() if v is not None}
    return subprocess.run([*command, *args], env=full_env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_saves_publish_by_manifest_and_rotation_keeps_the_newest(reference):
    assert [store.step_of(u) for u in store.complete("s3://bucket/run")] == [6, 4]
    assert objstore.children("s3://bucket/run") == ["s3://bucket/run/step_4", "s3://bucket/run/step_6"]  # step_2's objects are gone
    data = objstore.verify("s3://bucket/run/step_6", checksums=True)
    assert {".metadata", "__0_0.distcp", "train_state.json", "plan.json", "rng/rank_00000.json"} <= set(data["files"])
    objstore.filesystem("s3://bucket").pipe_file("bucket/run/step_6/plan.json", b"{}")  # same name, other bytes
    with pytest.raises(UserError, match="step_6/plan.json: (truncated|checksum mismatch)"):
        objstore.verify("s3://bucket/run/step_6", checksums=True)


def test_resume_from_s3_gives_the_same_losses(reference, tmp_path):
    run_dir, expected = reference
    plan, path = plan_for_resume(["ckpt=s3://bucket/run/step_4", f"run.dir={tmp_path}", "checkpoint.dir=s3://bucket/resumed"])
    assert path == "s3://bucket/run/step_4"
    run(plan, rank=RankInfo(), resume_from=path)
    got = losses(tmp_path)
    assert sorted(got) == [5, 6] and all(got[s] == expected[s] for s in got), (got, expected)  # bit-identical
    assert [store.step_of(u) for u in store.complete("s3://bucket/resumed")] == [6]


def test_a_save_the_storage_refuses_names_the_newest_checkpoint(reference, monkeypatch):
    """The server fails mid-upload: one message, the step's objects gone, the older checkpoint kept."""
    import torch
    from torch.distributed.checkpoint import _fsspec_filesystem

    from llmforge.checkpoint.state import _init_optimizer_state

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    _init_optimizer_state(optimizer)
    saver = store.CheckpointSaver(root="s3://bucket/refused", keep=2, async_save=False, rank=0, log=lambda _: None)
    saver.save(step=1, model_parts=[model], optimizer=optimizer, train_state={}, plan={})

    def refused(self, *args, **kwargs):
        raise OSError(121, "Internal Server Error")

    monkeypatch.setattr(_fsspec_filesystem.FsspecWriter, "write_data", refused)
    with pytest.raises(
        UserError, match=r"step 2 .*Internal Server Error; the newest complete checkpoint, s3://bucket/refused/step_1, is kept"
    ) as err:
        saver.save(step=2, model_parts=[model], optimizer=optimizer, train_state={}, plan={})
    assert err.value.problems[0].key == "checkpoint.dir"
    assert store.step_dirs("s3://bucket/refused") == ["s3://bucket/refused/step_1"]


def test_another_run_dir_needs_its_own_prefix(reference, tmp_path):
    with pytest.raises(UserError, match="checkpoint.dir"):
        plan_for_resume(["ckpt=s3://bucket/run/latest", f"run.dir={tmp_path}", "train.steps=8"])


def test_a_save_killed_midway_is_skipped_and_resume_reshards_to_dp2(reference, s3, small_data, tmp_path):
    """SIGKILL before step 4's manifest: resume (under dp2, two gloo ranks) takes step 2, the
    newest complete checkpoint, and trains on to the uninterrupted run's losses."""
    _, expected = reference
    args = [*TINY, *small_data, f"run.dir={tmp_path / 'killed'}", "checkpoint.dir=s3://bucket/killed", "checkpoint.keep=5"]
    killed = _cli(["pretrain", *args], env=s3, script=KILL_AT_STEP_4)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [store.step_of(u) for u in store.step_dirs("s3://bucket/killed")] == [4, 2]  # step_4 has objects, no manifest
    assert [store.step_of(u) for u in store.complete("s3://bucket/killed")] == [2]
    resumed = _cli(["resume", "ckpt=s3://bucket/killed/latest", "parallel=dp2"], env=s3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping step_4" in resumed.stderr and "falling back to step_2" in resumed.stderr
    got = losses(tmp_path / "killed")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert got == pytest.approx(expected, rel=1e-5)  # another layout: the same numbers up to reduction order
    assert [store.step_of(u) for u in store.complete("s3://bucket/killed")] == [6, 4, 2]  # the stale step_4 was cleared and saved anew
    saved = objstore.read_json("s3://bucket/killed/step_6/plan.json")
    assert saved["derived"]["world_size"] == 2


@pytest.mark.parametrize(
    "case, url, extra, message",
    [
        ("no bucket", "s3://no-such-bucket/run", {}, "the bucket 'no-such-bucket' does not exist"),
        (
            "no credentials",
            "s3://bucket/run",
            {
                "AWS_ACCESS_KEY_ID": None,
                "AWS_SECRET_ACCESS_KEY": None,
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
                "AWS_CONFIG_FILE": "/nonexistent/config",
                "AWS_PROFILE": None,
            },
            "no credentials were found",
        ),
        (
            "unreachable",
            "s3://bucket/run",
            {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{pick_free_port()}", "AWS_MAX_ATTEMPTS": "1"},
            "the storage endpoint does not answer",
        ),
    ],
)
def test_storage_mistakes_are_named_before_any_work(s3, monkeypatch, case, url, extra, message):
    import s3fs

    from llmforge.storage import check_reachable

    for key, value in extra.items():
        monkeypatch.delenv(key, raising=False) if value is None else monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # a fresh client reads the changed environment
    try:
        with pytest.raises(UserError, match=message) as err:
            check_reachable(url)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert err.value.problems[0].key == "checkpoint.dir" and err.value.problems[0].fix


def test_a_missing_backend_package_ends_the_command_with_exit_2(small_data, tmp_path):
    if _has("gcsfs"):
        pytest.skip("gcsfs is installed")
    got = _cli(["pretrain", *TINY, *small_data, f"run.dir={tmp_path}", "checkpoint.dir=gs://bucket/run"], env={}, timeout=120)
    assert got.returncode == 2, got.stderr[-2000:]
    assert "gs:// needs the gcsfs package" in got.stderr and "checkpoint.dir" in got.stderr and "Traceback" not in got.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_run_dir_must_be_local(small_data):
    with pytest.raises(UserError, match="run.dir.*must be a local folder"):
        RunPlan.build(compose([*TINY, *small_data, "run.dir=s3://bucket/run"]))
