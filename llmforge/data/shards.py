"""Tokenize documents and pack them into memory-mapped token shards.

Layout of one stream folder::

    tokens_00000.bin   raw token ids (uint16 or uint32), documents back to back,
    tokens_00001.bin   each ending in the end-of-document token
    doc_ends.npy       int64 end offset of every document in the concatenated stream

Tokens go straight from the tokenizer into numpy and onto disk in batches, so memory
stays bounded by one batch however large the corpus is. Each shard's SHA-256 is computed
from the same batches as they are written (no second read) and recorded in the manifest
with the file's stat, so a reused cache can tell an altered shard (llmforge.data.cache).
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmforge.data.documents import Documents, split_long
from llmforge.files import file_stamp

if TYPE_CHECKING:  # imported where used: the estimator reads the data cache without `tokenizers`
    from tokenizers import Tokenizer

SHARD_TOKENS = 1 << 28  # 512 MB of uint16 per shard file
PIECE_CHARS = 1 << 16  # long documents are encoded in pieces of about this many characters
BATCH_CHARS = 1 << 20  # characters per batch handed to the tokenizer (or to one worker)

Progress = Callable[[int], None]  # called with the number of documents just finished


@dataclass
class PackStats:
    """What one stream folder holds."""

    num_tokens: int = 0
    num_documents: int = 0
    skipped_empty: int = 0
    shards: list[dict] = field(default_factory=list)


def encode_documents(tokenizer: Tokenizer, texts: list[str | None], *, eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, int]:
    """Token ids of the non-empty texts, each followed by eos; their lengths; the number skipped."""
    kept = [t for t in texts if t]
    pieces: list[str] = []
    owner: list[int] = []
    for i, text in enumerate(kept):
        parts = split_long(text, max_chars=PIECE_CHARS)
        pieces.extend(parts)
        owner.extend([i] * len(parts))
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encodings = encode(pieces, add_special_tokens=False)
    piece_lens = np.fromiter((len(e) for e in encodings), dtype=np.int64, count=len(encodings))
    flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=dtype, count=int(piece_lens.sum()))
    doc_lens = np.bincount(np.asarray(owner, dtype=np.int64), weights=piece_lens, minlength=len(kept)).astype(np.int64)
    ids = np.insert(flat, np.cumsum(doc_lens), np.asarray(eos_id, dtype=dtype))
    return ids, doc_lens + 1, len(texts) - len(kept)


class ShardWriter:
    """Appends token batches to rolling shard files and records document ends."""

    def __init__(self, out_dir: Path, *, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS) -> None:
        self.out_dir = out_dir
        self.dtype = np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.stats = PackStats()
        self._doc_lens: list[np.ndarray] = []
        self._fh = None
        self._hash = None
        self._in_shard = 0
        out_dir.mkdir(parents=True, exist_ok=True)

    def write(self, ids: np.ndarray, doc_lens: np.ndarray) -> None:
        """Append tokens (documents may straddle two shard files)."""
        self._doc_lens.append(doc_lens)
        self.stats.num_documents += len(doc_lens)
        start = 0
        while start < len(ids):
            if self._fh is None or self._in_shard == self.shard_tokens:
                self._open_next()
            take = min(len(ids) - start, self.shard_tokens - self._in_shard)
            chunk = ids[start : start + take]
            chunk.tofile(self._fh)
            self._hash.update(chunk)
            self._in_shard += take
            self.stats.shards[-1]["tokens"] += take
            start += take
        self.stats.num_tokens += len(ids)

    def _open_next(self) -> None:
        self._finish_shard()
        name = f"tokens_{len(self.stats.shards):05d}.bin"
        self._fh = open(self.out_dir / name, "wb")
        self._hash = hashlib.sha256()
        self._in_shard = 0
        self.stats.shards.append({"file": name, "tokens": 0})

    def _finish_shard(self) -> None:
        """Close the current shard file and record its hash and stat (size, mtime, ctime)."""
        if self._fh is None:
            return
        self._fh.close()
        self._fh = None
        shard = self.stats.shards[-1]
        shard["sha256"] = self._hash.hexdigest()
        shard["stat"] = file_stamp(self.out_dir / shard["file"])

    def close(self) -> PackStats:
        """Flush the last shard and write doc_ends.npy."""
        self._finish_shard()
        lens = np.concatenate(self._doc_lens) if self._doc_lens else np.zeros(0, dtype=np.int64)
        np.save(self.out_dir / "doc_ends.npy", np.cumsum(lens, dtype=np.int64))
        return self.stats


def pack(
    docs: Documents,
    *,
    tokenizer_path: Path,
    eos_id: int,
    dtype: np.dtype,
    out_dir: Path,
    num_proc: int = 1,
    progress: Progress | None = None,
) -> PackStats:
    """Tokenize every document of docs into out_dir; num_proc > 1 uses worker processes."""
    writer = ShardWriter(out_dir, dtype=dtype)
    batches = docs.batches(batch_size=rows_per_batch(docs))
    skipped = 0
    for ids, doc_lens, n_skipped, n_rows in _encoded(batches, tokenizer_path=tokenizer_path, eos_id=eos_id, dtype=dtype, num_proc=num_proc):
        writer.write(ids, doc_lens)
        skipped += n_skipped
        if progress is not None:
            progress(n_rows)
    stats = writer.close()
    stats.skipped_empty = skipped
    return stats


def rows_per_batch(docs: Documents) -> int:
    """Documents per batch so that a batch holds about BATCH_CHARS characters."""
    sizes = [os.path.getsize(f) for f in docs.source.files]
    if not sizes or docs.num_rows == 0:
        return 1024
    average = max(1, sum(sizes) // docs.num_rows)
    return int(min(8192, max(1, BATCH_CHARS // average)))


def _encoded(batches: Iterable[list[str]], *, tokenizer_path: Path, eos_id: int, dtype: np.dtype, num_proc: int):
    from tokenizers import Tokenizer

    if num_proc <= 1:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        for texts in batches:
            yield (*encode_documents(tokenizer, texts, eos_id=eos_id, dtype=dtype), len(texts))
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_proc, initializer=_init_worker, initargs=(str(tokenizer_path), eos_id, dtype.str)) as pool:
        yield from pool.imap(_encode_in_worker, batches, chunksize=1)


_WORKER: dict = {}


def _init_worker(tokenizer_path: str, eos_id: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER.update(tokenizer=Tokenizer.from_file(tokenizer_path), eos_id=eos_id, dtype=np.dtype(dtype))


def _encode_in_worker(texts: list[str]):
    ids, doc_lens, skipped = encode_documents(_WORKER["tokenizer"], texts, eos_id=_WORKER["eos_id"], dtype=_WORKER["dtype"])
    return ids, doc_lens, skipped, len(texts)
