"""Data preparation under faults and altered input: tokenizers whose ids do not fit, token
shards changed after they were written, a full disk, SIGTERM, and pre-tokens megabytes long.
Each ends in one message naming the file or folder and the fix, with nothing half-written."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llmforge.config.schema import DataConfig
from llmforge.data import cache
from llmforge.data.build import _training_text
from llmforge.data.prepare import prepare
from llmforge.data.sampler import BatchSampler
from llmforge.data.tokenizer import MAX_RUN_CHARS, cap_runs, train_bpe
from llmforge.errors import UserError
from llmforge.testing.faults import file_size_limit

VOCAB = 300
TEXT = "the quick brown fox jumps over the lazy dog and runs far away\n\n" * 400


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def _prepare(tmp_path: Path, **fields):
    data = DataConfig(path=str(_corpus(tmp_path)), cache_dir=str(tmp_path / "cache"), **fields)
    return prepare(data=data, vocab_size=VOCAB, seed=0)


def _tokenizer_with_id(tmp_path: Path, token_id: int) -> Path:
    """A tokenizer.json of about 300 tokens whose most merged token has id ``token_id`` (ids with a gap)."""
    spec = json.loads(train_bpe([[TEXT]], vocab_size=VOCAB).to_str())
    vocab = spec["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = token_id
    path = tmp_path / f"tok{token_id}.json"
    path.write_text(json.dumps(spec))
    return path


def test_missing_tokenizer_creates_nothing_in_the_cache(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        _prepare(tmp_path, tokenizer=str(tmp_path / "nope.json"))
    assert not (tmp_path / "cache").exists()


def test_tokenizer_ids_past_the_vocabulary_are_refused_before_preparing(tmp_path):
    path = _tokenizer_with_id(tmp_path, 60000)
    with pytest.raises(UserError) as info:
        prepare(
            data=DataConfig(path=str(_corpus(tmp_path)), tokenizer=str(path), cache_dir=str(tmp_path / "cache")), vocab_size=512, seed=0
        )
    message = info.value.message()
    assert str(path) in message and "largest token id is 60000" in message and "512" in message
    assert "model.vocab_size=60001" in message
    assert not (tmp_path / "cache").exists()


def test_ids_past_uint16_make_uint32_shards(tmp_path):
    path = _tokenizer_with_id(tmp_path, 70000)
    data = DataConfig(path=str(_corpus(tmp_path)), tokenizer=str(path), cache_dir=str(tmp_path / "cache"))
    prepared = prepare(data=data, vocab_size=70016, seed=0)
    assert prepared.dtype == "uint32" and prepared.vocab_size == 70001
    assert int(prepared.open_stream(0).slice(0, prepared.num_tokens).max()) == 70000


def _shard(prepared) -> Path:
    return prepared.streams[0].folder / prepared.streams[0].shards[0][0]


def _overwrite(path: Path, value: int, dtype) -> None:
    tokens = np.memmap(path, dtype=dtype, mode="r+")
    tokens[3:9] = value
    tokens.flush()
    del tokens


def test_shard_altered_in_place_is_found_by_its_hash_and_rebuilt(tmp_path):
    first = _prepare(tmp_path)
    original = first.open_stream(0).slice(0, first.num_tokens).copy()
    manifest = json.loads((first.root / "manifest.json").read_text())
    assert all(len(s["sha256"]) == 64 for s in manifest["streams"][0]["shards"])
    _overwrite(_shard(first), 5, first.dtype)  # same size, ids still inside the vocabulary
    second = _prepare(tmp_path)
    assert not second.reused
    assert np.array_equal(second.open_stream(0).slice(0, second.num_tokens), original)
    assert _prepare(tmp_path).reused


def test_stale_reason_names_the_altered_shard(tmp_path):
    prepared = _prepare(tmp_path)
    _overwrite(_shard(prepared), 7, prepared.dtype)
    manifest = cache.read_manifest(prepared.root)
    reason = cache.stale_reason(prepared.root, manifest, spec=manifest["spec"], inputs=manifest["inputs"])
    assert str(_shard(prepared)) in reason and "altered" in reason


def test_sampler_refuses_a_shard_with_ids_past_the_vocabulary(tmp_path):
    prepared = _prepare(tmp_path)
    sampler = BatchSampler(prepared, seq_len=16, global_batch_size=len(TEXT) // 64, seed=0)
    _overwrite(_shard(prepared), 65000, prepared.dtype)  # altered after the cache check, while the run reads it
    with pytest.raises(UserError) as info:
        sampler.next_batch(dp_rank=0, dp_size=1)
    message = info.value.message()
    assert str(_shard(prepared)) in message and "65000" in message and str(prepared.root) in message
    assert "llmforge data prepare --force" in message


def test_stale_temporary_folders_are_removed_by_the_next_preparation(tmp_path):
    prepared = _prepare(tmp_path)
    dead = prepared.root.parent / f".{prepared.root.name}.tmp-999999-0a1b2c3d"
    (dead / "streams").mkdir(parents=True)
    assert _prepare(tmp_path).reused and not dead.exists()


def _prepare_in_child(tmp_path: Path, *extra: str, limit_bytes: int = 0) -> subprocess.Popen:
    def limit() -> None:
        if limit_bytes:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    command = [sys.executable, "-m", "llmforge", "data", "prepare", f"data.cache_dir={tmp_path / 'cache'}", *extra]
    return subprocess.Popen(command, preexec_fn=limit, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _left_in_cache(tmp_path: Path) -> list:
    return sorted(p.name for p in (tmp_path / "cache" / "prepared").iterdir() if not p.name.endswith(".lock"))


def test_full_disk_names_the_cache_folder_and_removes_the_partial_entry(tmp_path):
    child = _prepare_in_child(tmp_path, "data.builtin_max_mb=0.3", f"data.vocab_size={VOCAB}", limit_bytes=60_000)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 2, out + err
    assert "Traceback" not in err and f"data.cache_dir = '{tmp_path / 'cache'}'" in err
    assert "needs about" in err and "free" in err and "ulimit -f" in err
    assert _left_in_cache(tmp_path) == []


def test_a_tokenizer_that_cannot_be_written_under_the_file_size_limit_is_the_full_disk_message(tmp_path):
    data = DataConfig(path=str(_corpus(tmp_path)), cache_dir=str(tmp_path / "cache"))
    entry = prepare(data=data, vocab_size=VOCAB, seed=0).root  # the text's copy is kept: a rebuild first writes tokenizer.json
    with file_size_limit(1_000), pytest.raises(UserError) as info:  # tokenizers (Rust) says "File too large (os error 27)"
        prepare(data=data, vocab_size=VOCAB, seed=0, force=True)
    assert "the disk filled up" in info.value.message() and "ulimit -f" in info.value.message()
    assert _left_in_cache(tmp_path) == [entry.name]


# A shell reports 130 both for an exit with code 130 and for a death by SIGINT, which Python chooses
# itself when a KeyboardInterrupt reaches it after the command's own handler has run.
@pytest.mark.parametrize(
    "signum,codes,said",
    [(signal.SIGTERM, (-signal.SIGTERM,), "stopped by SIGTERM"), (signal.SIGINT, (130, -signal.SIGINT), "interrupted")],
)
def test_sigterm_and_sigint_during_preparation_remove_the_temporary_folder_with_a_message(tmp_path, signum, codes, said):
    child = _prepare_in_child(tmp_path, "data.builtin_max_mb=2", f"data.vocab_size={VOCAB}")
    prepared = tmp_path / "cache" / "prepared"
    deadline = time.monotonic() + 120
    while not (prepared.exists() and any(".tmp-" in p.name for p in prepared.iterdir())):
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.05)
    child.send_signal(signum)
    _, err = child.communicate(timeout=120)
    assert child.returncode in codes, err
    assert said in err and "Traceback" not in err
    assert _left_in_cache(tmp_path) == []


def test_long_runs_are_cut_for_training_and_the_text_is_kept():
    text = "start " + "a" * (5 * MAX_RUN_CHARS + 3) + " end"
    pieces = cap_runs(text)
    assert "".join(pieces) == text and len(pieces) == 6
    assert max(len(run) for piece in pieces for run in piece.split()) <= MAX_RUN_CHARS
    assert cap_runs("short words only") == ["short words only"]


def test_tokenizer_training_on_a_5mb_word_finishes_and_reports_progress():
    import datasets

    from llmforge.data.documents import Documents
    from llmforge.data.sources import Source

    table = datasets.Dataset.from_dict({"text": [TEXT, "x" * 5_000_000]})
    docs = Documents(table, Source(kind="builtin", files=(), spec="test", name="test"))
    notes: list = []
    tokenizer = train_bpe(_training_text([docs], budget=10**9, report=notes.append), vocab_size=VOCAB)
    assert tokenizer.get_vocab_size() <= VOCAB
    assert notes[-1].endswith("computing the merges") and "5.0 M characters read" in notes[-1]


def test_pretrain_refuses_an_unfit_tokenizer_before_any_rank_starts(tmp_path):
    from typer.testing import CliRunner

    from llmforge.cli import app

    path = _tokenizer_with_id(tmp_path, 60000)
    result = CliRunner().invoke(
        app,
        [
            "pretrain",
            "parallel=dp2",
            f"data.path={_corpus(tmp_path)}",
            f"data.tokenizer={path}",
            "model.vocab_size=512",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    assert result.exit_code == 2 and "largest token id is 60000" in result.output, result.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
