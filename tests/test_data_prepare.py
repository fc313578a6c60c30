"""prepare(): round trip, cache reuse and invalidation, shard layout, concurrency."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import numpy as np

from llmforge.config.schema import DataConfig
from llmforge.data.prepare import _load_tokenizer, prepare
from llmforge.data.shards import PIECE_CHARS
from llmforge.data.sources import builtin_source

VOCAB = 400


def _write_jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def _texts(n: int = 40):
    return [f"Document {i}: the quick brown fox jumps over {i * 7} lazy dogs.\n  déjà vu — ünïcode ✓ {i}\n" for i in range(n)]


def _decoded_documents(prepared, stream: int = 0):
    docs = prepared.open_stream(stream).documents()
    assert all(int(d[-1]) == prepared.eos_id for d in docs)
    return [prepared.decode(d[:-1]) for d in docs]


def test_jsonl_round_trip_reproduces_every_document(tmp_path):
    texts = _texts()
    src = _write_jsonl(tmp_path / "docs.jsonl", texts)
    prepared = prepare(data=DataConfig(path=str(src), cache_dir=str(tmp_path / "c")), vocab_size=VOCAB, seed=0)
    assert _decoded_documents(prepared) == texts
    assert prepared.vocab_size <= VOCAB and prepared.dtype == "uint16"
    assert prepared.num_tokens == prepared.open_stream(0).num_tokens


def test_text_folder_round_trip_including_a_long_document(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    long_doc = "".join(f"def f{i}(x):  \n    return x + {i}\n\nclass C{i}:\n pass\n" for i in range(PIECE_CHARS // 20))
    assert len(long_doc) > 2 * PIECE_CHARS
    (folder / "a.txt").write_text("short one\n", encoding="utf-8")
    (folder / "b.txt").write_text(long_doc, encoding="utf-8")
    prepared = prepare(data=DataConfig(path=str(folder), cache_dir=str(tmp_path / "c")), vocab_size=VOCAB, seed=0)
    assert _decoded_documents(prepared) == ["short one\n", long_doc]
    whole = _load_tokenizer(str(prepared.tokenizer_path)).encode(long_doc).ids
    assert prepared.open_stream(0).documents()[1][:-1].tolist() == whole


def test_builtin_corpus_is_standard_library_source_and_round_trips(tmp_path):
    data = DataConfig(cache_dir=str(tmp_path), builtin_max_mb=0.1)
    prepared = prepare(data=data, vocab_size=VOCAB, seed=0)
    files = builtin_source(max_mb=0.1).files
    assert 0.1e6 <= sum(os.path.getsize(f) for f in files) < 0.1e6 + max(os.path.getsize(f) for f in files)
    assert _decoded_documents(prepared) == [Path(f).read_text(encoding="utf-8") for f in files]
    assert all("site-packages" not in f for f in files)


def test_parquet_with_custom_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts(10)
    pq.write_table(pa.table({"body": texts, "n": list(range(10))}), tmp_path / "d.parquet")
    data = DataConfig(path=str(tmp_path / "d.parquet"), text_key="body", cache_dir=str(tmp_path / "c"))
    assert _decoded_documents(prepare(data=data, vocab_size=VOCAB, seed=0)) == texts


def test_cache_is_reused_touched_file_too_and_changed_content_rebuilds(tmp_path):
    src = _write_jsonl(tmp_path / "docs.jsonl", _texts())
    data = DataConfig(path=str(src), cache_dir=str(tmp_path / "c"))
    first = prepare(data=data, vocab_size=VOCAB, seed=0)
    shard = first.streams[0].folder / first.streams[0].shards[0][0]
    stamp = shard.stat().st_mtime_ns
    again = prepare(data=data, vocab_size=VOCAB, seed=99)
    assert again.reused and again.root == first.root and shard.stat().st_mtime_ns == stamp
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))  # same bytes, new mtime: the hash decides
    assert prepare(data=data, vocab_size=VOCAB, seed=0).reused
    _write_jsonl(src, _texts()[:-1] + ["a different last document"])
    changed = prepare(data=data, vocab_size=VOCAB, seed=0)
    assert not changed.reused and changed.root == first.root
    assert _decoded_documents(changed)[-1] == "a different last document"
    assert prepare(data=data, vocab_size=VOCAB, seed=0, force=True).reused is False


def test_other_vocab_size_is_another_entry_and_damaged_shard_rebuilds(tmp_path):
    src = _write_jsonl(tmp_path / "docs.jsonl", _texts())
    data = DataConfig(path=str(src), cache_dir=str(tmp_path / "c"))
    a = prepare(data=data, vocab_size=VOCAB, seed=0)
    b = prepare(data=data, vocab_size=VOCAB + 100, seed=0)
    assert a.root != b.root
    shard = a.streams[0].folder / a.streams[0].shards[0][0]
    shard.write_bytes(shard.read_bytes()[:-2])
    repaired = prepare(data=data, vocab_size=VOCAB, seed=0)
    assert not repaired.reused and _decoded_documents(repaired) == _texts()
    leftovers = [p.name for p in (tmp_path / "c" / "prepared").iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


def test_worker_processes_write_the_same_tokens(tmp_path):
    src = _write_jsonl(tmp_path / "docs.jsonl", _texts(200))
    one = prepare(data=DataConfig(path=str(src), cache_dir=str(tmp_path / "c1")), vocab_size=VOCAB, seed=0)
    tok = one.tokenizer_path.read_text()
    data = DataConfig(path=str(src), cache_dir=str(tmp_path / "c2"), tokenizer=str(one.tokenizer_path), num_proc=2)
    two = prepare(data=data, vocab_size=VOCAB, seed=0)
    assert two.tokenizer_path.read_text() == tok
    assert np.array_equal(np.asarray(one.open_stream(0).slice(0, one.num_tokens)), np.asarray(two.open_stream(0).slice(0, two.num_tokens)))


def test_given_tokenizer_json_is_used(tmp_path):
    src = _write_jsonl(tmp_path / "docs.jsonl", _texts())
    base = prepare(data=DataConfig(path=str(src), cache_dir=str(tmp_path / "c")), vocab_size=VOCAB, seed=0)
    other = _write_jsonl(tmp_path / "other.jsonl", ["brown fox, lazy dogs"])
    data = DataConfig(path=str(other), cache_dir=str(tmp_path / "c"), tokenizer=str(base.tokenizer_path))
    prepared = prepare(data=data, vocab_size=VOCAB, seed=0)
    assert prepared.tokenizer_path.read_text() == base.tokenizer_path.read_text()
    assert _decoded_documents(prepared) == ["brown fox, lazy dogs"]


def _prepare_in_child(path: str, cache: str, queue) -> None:
    prepared = prepare(data=DataConfig(path=path, cache_dir=cache), vocab_size=VOCAB, seed=0)
    queue.put((str(prepared.root), prepared.num_tokens))


def test_concurrent_prepare_calls_agree(tmp_path):
    src = _write_jsonl(tmp_path / "docs.jsonl", _texts(300))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(str(src), str(tmp_path / "c"), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1]
    entries = [p.name for p in (tmp_path / "c" / "prepared").iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1
