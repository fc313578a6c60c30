"""A checkpoint.dir in object storage belongs to one run: another run is refused it, the same
run started again is told where its checkpoints are and how to resume (and that hint works),
--overwrite deletes everything the earlier run left there, a save refuses a prefix another run
owns, and no output command writes a URL to a local look-alike path (moto's S3 server on
localhost; one process, a tiny model, a few steps)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_object_storage import s3  # noqa: F401  (the moto server fixture)
from typer.testing import CliRunner

from llmforge.checkpoint import objstore, owner, store
from llmforge.checkpoint.locate import locate
from llmforge.cli import app
from llmforge.errors import UserError

TINY = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "checkpoint.interval=1",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "optim.warmup_steps=1",
]
runner = CliRunner()


def cli(*args: str, code: int) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code and "Traceback" not in result.output, result.output
    return " ".join(result.output.split())


def steps(url: str) -> list[int]:
    return [store.step_of(u) for u in store.complete(url)]


def saved_by(url: str) -> str:
    return objstore.read_json(f"{url}/plan.json")["config"]["run"]["dir"]


def test_a_checkpoint_dir_belongs_to_one_run(s3, small_data, tmp_path):  # noqa: F811
    a, b, url = tmp_path / "a", tmp_path / "b", "s3://bucket/owned"
    cli("pretrain", *TINY, *small_data, "train.steps=1", f"run.dir={a}", f"checkpoint.dir={url}", code=0)
    assert owner.read_owner(url)["run_dir"] == str(a.resolve()) and steps(url) == [1]

    taken = cli("pretrain", *TINY, *small_data, "train.steps=2", f"run.dir={b}", f"checkpoint.dir={url}", code=2)
    assert f"holds the checkpoints of the run in {a.resolve()}" in taken and f"checkpoint.dir={url}-2" in taken
    assert steps(url) == [1] and not b.exists()

    again = cli("pretrain", *TINY, *small_data, "train.steps=2", f"run.dir={a}", f"checkpoint.dir={url}", code=2)
    assert f"its checkpoints are in {url}" in again and "saved no complete checkpoint" not in again
    hint = re.search(r"`llmforge resume (ckpt=\S+)`", again).group(1)
    assert hint == f"ckpt={a}"
    resumed = cli("resume", hint, "train.steps=2", code=0)
    assert f"resuming from {url}/step_1 (step 1) into {a}" in resumed and steps(url) == [2, 1]
    assert locate(str(a / "checkpoints" / "latest")).path == f"{url}/step_2"

    cli("pretrain", *TINY, *small_data, "train.steps=1", f"run.dir={b}", f"checkpoint.dir={url}", "--overwrite", code=0)
    assert objstore.step_dirs(url) == [f"{url}/step_1"] and steps(url) == [1]  # a's step_2 is gone
    assert saved_by(f"{url}/step_1") == str(b) and owner.read_owner(url)["run_dir"] == str(b.resolve())
    taken_over = cli("resume", f"ckpt={a}", "train.steps=3", code=2)  # a's plan still names the prefix, which b now owns
    assert f"holds the checkpoints of the run in {b.resolve()}" in taken_over and steps(url) == [1]


def test_a_save_refuses_a_prefix_another_run_owns(s3, tmp_path):  # noqa: F811
    """Where no launcher ran on this machine (a cluster job) the first save records the owner; every
    save refuses a prefix another run owns, also one taken over while this run trained."""
    import torch

    from llmforge.checkpoint.state import _init_optimizer_state

    url = "s3://bucket/saved"
    owner.record_owner(url, run_dir=tmp_path / "first")
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    _init_optimizer_state(optimizer)
    saver = store.CheckpointSaver(root=url, keep=2, async_save=False, rank=0, log=lambda _: None, run_dir=tmp_path / "second")
    with pytest.raises(UserError, match="holds the checkpoints of the run in .*first"):
        saver.save(step=1, model_parts=[model], optimizer=optimizer, train_state={}, plan={})
    assert objstore.step_dirs(url) == []
    mine = store.CheckpointSaver(root=url, keep=2, async_save=False, rank=0, log=lambda _: None, run_dir=tmp_path / "first")
    mine.save(step=1, model_parts=[model], optimizer=optimizer, train_state={}, plan={})
    assert steps(url) == [1]
    owner.record_owner(url, run_dir=tmp_path / "third")  # --overwrite by another run while this one trains
    with pytest.raises(UserError, match="holds the checkpoints of the run in .*third"):
        mine.save(step=2, model_parts=[model], optimizer=optimizer, train_state={}, plan={})
    assert objstore.step_dirs(url) == [f"{url}/step_1"]  # no step_2 written, nothing rotated


def test_a_store_held_in_this_process_is_refused_whatever_its_name(tmp_path):
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from llmforge.storage import check_reachable

    class Scratch(MemoryFileSystem):
        protocol = "scratch-llmforge-test"

    fsspec.register_implementation("scratch-llmforge-test", Scratch, clobber=True)
    with pytest.raises(UserError, match="in the memory of this process"):
        check_reachable("scratch-llmforge-test://bucket/run")


@pytest.mark.parametrize("command", ["generate", "export"])
@pytest.mark.parametrize("url", ["s3://bucket/out.jsonl", "s3:/bucket/out.jsonl"])
def test_an_output_url_is_refused_not_written_to_a_local_look_alike(tmp_path, monkeypatch, command, url):
    monkeypatch.chdir(tmp_path)
    extra = ["--prompt", "x"] if command == "generate" else []
    text = cli(command, f"ckpt={tmp_path / 'no-run'}", *extra, "--out", url, code=2)
    assert f"--out = '{url}'" in text and "Fix:" in text
    assert list(Path(tmp_path).iterdir()) == []


def test_a_stopped_object_storage_run_without_a_checkpoint_names_its_own_run_dir(s3, tmp_path):  # noqa: F811
    from llmforge.train.anomaly import Anomaly
    from llmforge.train.recovery import stop_error

    anomaly = Anomaly(action="stop", first_step=1, step=1, what="the loss was nan", reason="train.anomaly=stop")
    text = stop_error(anomaly, root="s3://bucket/never-saved", run_dir=tmp_path / "run").message()
    assert f"run.dir={tmp_path / 'run'} --overwrite" in text and "RUN_DIR" not in text
