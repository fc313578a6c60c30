"""Checkpoint store: round trip, rotation, async save, faults, safe loading, SIGKILL mid-save."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llmforge.checkpoint import store
from llmforge.checkpoint.locate import locate
from llmforge.checkpoint.manifest import MANIFEST, verify
from llmforge.checkpoint.safe_reader import load_metadata
from llmforge.config.schema import ModelConfig, OptimConfig
from llmforge.errors import UserError
from llmforge.models.gpt import GPT
from llmforge.train.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]


def tiny(seed: int = 1):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64, vocab_size=64, seq_len=16)
    model = GPT(cfg)
    model.init_weights(seed=seed)
    optimizer = build_optimizer(model, optim=OptimConfig(), lr=1e-2)
    return model, optimizer


def train_one(model, optimizer, *, seed: int) -> None:
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def saver(root: Path, *, keep: int = 0, async_save: bool = False) -> store.CheckpointSaver:
    return store.CheckpointSaver(root=root, keep=keep, async_save=async_save, rank=0, log=lambda text: None)


def save(s: store.CheckpointSaver, model, optimizer, step: int) -> Path:
    return s.save(step=step, model_parts=[model], optimizer=optimizer, train_state={"marker": step}, plan={"config": {}})


def assert_same_state(a_model, a_opt, b_model, b_opt) -> None:
    for (name, a), b in zip(a_model.state_dict().items(), b_model.state_dict().values(), strict=False):
        assert torch.equal(a, b), name
    for pa, pb in zip(a_model.parameters(), b_model.parameters(), strict=False):
        for key, value in a_opt.state[pa].items():
            assert torch.equal(value, b_opt.state[pb][key]), key


@pytest.fixture
def saved(tmp_path):
    """Two checkpoints (steps 1 and 2) of a trained tiny model."""
    model, optimizer = tiny()
    s = saver(tmp_path / "checkpoints")
    for step in (1, 2):
        train_one(model, optimizer, seed=step)
        save(s, model, optimizer, step)
    return tmp_path / "checkpoints", model, optimizer


def test_round_trip_restores_model_optimizer_and_train_state(saved):
    root, model, optimizer = saved
    fresh, fresh_opt = tiny(seed=99)
    state = store.load(path=root / "step_2", model_parts=[fresh], optimizer=fresh_opt)
    assert state == {"step": 2, "marker": 2}
    assert_same_state(model, optimizer, fresh, fresh_opt)
    manifest = verify(root / "step_2", checksums=True)
    assert {".metadata", "train_state.json", "plan.json", "rng/rank_00000.json"} <= set(manifest["files"])


def test_rotation_keeps_the_newest(tmp_path):
    model, optimizer = tiny()
    s = saver(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        save(s, model, optimizer, step)
    assert [p.name for p in store.complete(tmp_path)] == ["step_4", "step_3"]
    (tmp_path / "step_4" / MANIFEST).unlink()  # the newest is now incomplete
    s.keep = 1
    save(s, model, optimizer, 5)
    assert [p.name for p in store.complete(tmp_path)] == ["step_5"]
    assert not any(p.name.startswith((".tmp", ".del")) for p in tmp_path.iterdir())


def test_async_save_snapshots_state_before_training_continues(tmp_path):
    model, optimizer = tiny()
    train_one(model, optimizer, seed=1)
    expected, expected_opt = tiny(seed=5)
    expected.load_state_dict(model.state_dict())
    s = saver(tmp_path, async_save=True)
    path = save(s, model, optimizer, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training moves on while the write may still run
    s.close()
    assert s.records[0].mode == "async" and s.records[0].stall_s >= 0
    loaded, loaded_opt = tiny(seed=7)
    store.load(path=path, model_parts=[loaded], optimizer=loaded_opt)
    for a, b in zip(expected.state_dict().values(), loaded.state_dict().values(), strict=False):
        assert torch.equal(a, b)


def _shard(step_dir: Path) -> Path:
    return next(step_dir.glob("*.distcp"))


def test_truncated_shard_is_named(saved):
    root, *_ = saved
    shard = _shard(root / "step_2")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match=rf"{shard.name}: truncated"):
        verify(root / "step_2", checksums=False)
    fresh, fresh_opt = tiny()
    with pytest.raises(UserError, match="truncated"):
        store.load(path=root / "step_2", model_parts=[fresh], optimizer=fresh_opt)


def test_missing_shard_and_bad_checksum_are_named(saved):
    root, *_ = saved
    _shard(root / "step_1").unlink()
    with pytest.raises(UserError, match=r"__0_0\.distcp: missing"):
        locate(str(root / "step_1"))
    shard = _shard(root / "step_2")
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"{shard.name}: checksum mismatch"):
        locate(str(root / "step_2"))


def test_missing_manifest_and_latest_fallback(saved):
    root, *_ = saved
    (root / "step_2" / MANIFEST).unlink()
    with pytest.raises(UserError, match=r"step_2/manifest.json: the manifest is missing"):
        locate(str(root / "step_2"))
    found = locate(str(root / "latest"))
    assert found.path == root / "step_1"
    assert any("skipping step_2" in n for n in found.notes) and any("falling back to step_1" in n for n in found.notes)
    assert locate(str(root.parent)).path == root / "step_1"
    (root / "step_1" / MANIFEST).unlink()
    with pytest.raises(UserError, match="no complete checkpoint"):
        locate(str(root / "latest"))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_with_foreign_objects_is_refused(saved, tmp_path, monkeypatch):
    root, *_ = saved
    monkeypatch.chdir(tmp_path)
    (root / "step_2" / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(UserError, match="refusing to load posix.system|refusing to load os.system"):
        load_metadata(root / "step_2")
    assert not (tmp_path / "pwned").exists()


_KILL_SCRIPT = """
import sys, time, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_checkpoint_store import tiny, saver, save, train_one
from llmforge.checkpoint import manifest, store
root = Path(sys.argv[1])
model, optimizer = tiny()
s = saver(root)
train_one(model, optimizer, seed=1)
save(s, model, optimizer, 1)
def stuck(folder, *, step):
    (root / "in-save").write_text("x")
    time.sleep(120)
store.write_manifest = stuck
train_one(model, optimizer, seed=2)
save(s, model, optimizer, 2)
"""


def test_sigkill_during_save_leaves_previous_checkpoint_usable(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    script = _KILL_SCRIPT.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script, str(root)], env=env, stderr=subprocess.PIPE)
    try:
        for _ in range(1200):
            if (root / "in-save").exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert (root / "in-save").exists(), proc.stderr.read().decode() if proc.poll() is not None else "save never started"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert (root / ".tmp-step_2").is_dir() and not (root / "step_2").exists()
    found = locate(str(root / "latest"))
    assert found.path == root / "step_1" and any(".tmp-step_2" in n for n in found.notes)
    model, optimizer = tiny(seed=3)
    assert store.load(path=found.path, model_parts=[model], optimizer=optimizer)["step"] == 1
    reference, reference_opt = tiny()
    train_one(reference, reference_opt, seed=1)
    assert_same_state(reference, reference_opt, model, optimizer)


def test_a_save_cut_short_by_a_second_ctrl_c_is_an_interruption_not_a_storage_fault(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    root, (model, optimizer) = tmp_path / "checkpoints", tiny()

    def second_ctrl_c(self, plan, planner):
        raise KeyboardInterrupt  # as StopSignal raises it inside DCP's write, which wraps it as a rank's failure

    monkeypatch.setattr(FileSystemWriter, "write_data", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        save(saver(root), model, optimizer, 1)
    assert list(root.iterdir()) == []  # its temporary folder went
