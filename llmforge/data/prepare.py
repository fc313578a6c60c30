"""Turn the data config into tokenized, memory-mapped shards, reusing a valid cache.

``prepare`` resolves the input (built-in corpus, files, or a mixture of several), trains
a byte-level BPE (or loads ``data.tokenizer``), tokenizes every document into token shards,
and writes a manifest. The cache entry is keyed by the request; its manifest records the
input files' hashes, so a changed file rebuilds the entry and an unchanged one reuses it.
Concurrent calls on the same entry wait on a file lock; a new entry appears by atomic rename.

This module imports no torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from rich.text import Text

from llmforge.config.choices import AttentionMask, DataSource
from llmforge.config.schema import DataConfig, RunConfig
from llmforge.data import cache
from llmforge.data.build import build
from llmforge.data.documents import open_documents
from llmforge.data.reader import TokenStream
from llmforge.data.sources import FileInfo, Source, builtin_source, file_source, fingerprint_file, parse_mixture
from llmforge.data.tokenizer import check_vocab_size, load_tokenizer
from llmforge.errors import Problem, UserError


@dataclass(frozen=True)
class StreamInfo:
    """One dataset of the prepared data (several for a mixture)."""

    name: str
    folder: Path
    weight: float
    num_tokens: int
    num_documents: int
    shards: tuple[tuple[str, int], ...]  # (file name, tokens)


@dataclass(frozen=True)
class PreparedData:
    """Tokenized data on disk, ready for the sampler."""

    root: Path  # folder with manifest.json, tokenizer.json and streams/<i>/ token shards + doc_ends.npy
    tokenizer_path: Path
    vocab_size: int  # actual tokenizer vocabulary size
    eos_id: int
    num_tokens: int
    dtype: str = "uint16"
    streams: tuple[StreamInfo, ...] = ()
    fingerprint: str = ""  # identity of the token content (tokenizer + shards)
    reused: bool = False  # True when an existing cache entry was used

    def decode(self, ids) -> str:
        """Text of a sequence of token ids (the end-of-document token decodes to nothing)."""
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return _load_tokenizer(str(self.tokenizer_path)).decode([int(i) for i in values], skip_special_tokens=True)

    def open_stream(self, index: int = 0) -> TokenStream:
        """Memory-mapped tokens of one stream."""
        info = self.streams[index]
        shards = [{"file": f, "tokens": n} for f, n in info.shards]
        return TokenStream(info.folder, shards=shards, dtype=self.dtype)


@lru_cache(maxsize=8)
def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def prepare(*, data: DataConfig, vocab_size: int, seed: int, console=None, force: bool = False) -> PreparedData:
    """Prepare (or reuse) the token shards for ``data``.

    vocab_size is data.vocab_size or model.vocab_size (resolved by the caller). Preparation
    is deterministic and does not depend on seed (the sampler's order does), so runs with
    different seeds share one cache entry. force=True rebuilds even a valid entry.
    Raises UserError for every mistake in the input.
    """
    del seed  # accepted so every data entry point takes the run seed; the shards do not depend on it
    if data.tokenizer is None:
        check_vocab_size(vocab_size)
    else:
        load_tokenizer(data.tokenizer, vocab_size=vocab_size)  # refused before anything is created
    inputs, spec, root = _entry(data, vocab_size=vocab_size)
    ready = None if force else _reuse_unlocked(root, inputs, spec=spec, tokenizer=data.tokenizer)
    if ready is not None and not cache.leftovers(root):
        return ready
    try:
        return _prepare_locked(root, data=data, inputs=inputs, spec=spec, vocab_size=vocab_size, console=console, force=force)
    except cache.CacheNotWritable:
        if ready is None:
            raise
        return ready  # the leftovers of a dead preparation stay where nobody can remove them


def reusable(*, data: DataConfig, vocab_size: int) -> PreparedData | None:
    """The cache entry ``prepare`` would return without building anything: valid and whole, read
    without its lock; None where it is missing, stale or left half-built. Raises ``prepare``'s
    UserError where the inputs themselves are wrong."""
    inputs, spec, root = _entry(data, vocab_size=vocab_size)
    ready = _reuse_unlocked(root, inputs, spec=spec, tokenizer=data.tokenizer)
    return ready if ready is not None and not cache.leftovers(root) else None


def _entry(data: DataConfig, *, vocab_size: int) -> tuple[list[tuple[Source, float]], dict, Path]:
    """(inputs with their weights, the cache key, the cache folder) of a preparation request."""
    inputs = resolve_inputs(data)
    spec = request_spec(data, inputs=inputs, vocab_size=vocab_size)
    return inputs, spec, _entry_root(data, inputs=inputs, spec=spec)


def _prepare_locked(
    root: Path, *, data: DataConfig, inputs: Sequence[tuple[Source, float]], spec: dict, vocab_size: int, console, force: bool
) -> PreparedData:
    """Check, and rebuild if needed, the entry under its lock."""
    with cache.preparing(root, input_bytes=sum(_input_bytes(s) for s, _ in inputs)):
        fingerprints = _fingerprint_inputs(root, inputs, tokenizer=data.tokenizer)
        manifest = None if force else cache.read_manifest(root)
        reason = "forced rebuild" if force else "not prepared yet"
        if manifest is not None:
            reason = cache.stale_reason(root, manifest, spec=spec, inputs=fingerprints) or ""
        if manifest is not None and not reason:
            return from_manifest(root, manifest, weights=[w for _, w in inputs], reused=True)
        if console is not None:
            console.print(Text.assemble(("Preparing data", "bold"), f" in {root} ({reason})"))
        with cache.staging(root) as tmp:
            manifest = build(tmp, inputs=[s for s, _ in inputs], data=data, vocab_size=vocab_size, console=console)
            manifest.update(spec=spec, inputs=fingerprints, created=time.time())
            cache.write_manifest(tmp, manifest)
    return from_manifest(root, manifest, weights=[w for _, w in inputs], reused=False)


def _reuse_unlocked(root: Path, inputs: Sequence[tuple[Source, float]], *, spec: dict, tokenizer: str | None) -> PreparedData | None:
    """A valid entry, read without taking its lock: a prepared cache stays usable where it is
    read-only (shared by many users). None (then prepare under the lock) when the entry is
    missing, stale, being replaced, or reads a hub dataset (whose check may write its cache)."""
    if any(source.kind == "hub" for source, _ in inputs):
        return None
    manifest = cache.read_manifest(root)
    if manifest is None:
        return None
    try:
        fingerprints = _fingerprint_inputs(root, inputs, tokenizer=tokenizer)
        if cache.stale_reason(root, manifest, spec=spec, inputs=fingerprints):
            return None
        return from_manifest(root, manifest, weights=[w for _, w in inputs], reused=True)
    except (OSError, KeyError, ValueError):
        return None


def _input_bytes(source: Source) -> int:
    """Bytes of text a source reads (0 for a hub dataset, whose size is not known here)."""
    return sum(Path(f).stat().st_size for f in source.files)


def prepared_document_ends(data: DataConfig, *, vocab_size: int) -> list[tuple[object, float]] | None:
    """(doc_ends, mixture weight) of every stream of the cache entry for ``data``, memory-mapped,
    without preparing or checking anything; None when there is no entry (or the input is missing)."""
    import numpy as np

    try:
        inputs, _, root = _entry(data, vocab_size=vocab_size)
    except UserError:
        return None
    manifest = cache.read_manifest(root)
    if manifest is None:
        return None
    try:
        return [
            (np.load(root / s["folder"] / "doc_ends.npy", mmap_mode="r"), float(w))
            for s, (_, w) in zip(manifest["streams"], inputs, strict=False)
        ]
    except (OSError, ValueError, KeyError):
        return None


def document_ends_for(config: RunConfig, *, vocab_size: int) -> list[tuple[object, float]] | None:
    """The prepared data's document ends where the attention mask follows documents
    (``model.attention_mask=document``), for the estimate: read once by the command that
    estimates; None (nothing read) for other masks or data not prepared yet."""
    if config.model.attention_mask != AttentionMask.DOCUMENT:
        return None
    return prepared_document_ends(config.data, vocab_size=vocab_size)


def _entry_root(data: DataConfig, *, inputs: Sequence[tuple[Source, float]], spec: dict) -> Path:
    """The cache folder of a preparation request."""
    return cache.entry_folder(data.cache_dir, name=inputs[0][0].name if len(inputs) == 1 else "mixture", spec=spec)


def resolve_inputs(data: DataConfig) -> list[tuple[Source, float]]:
    """The sources to prepare with their mixture weights (one source with weight 1 unless mixed)."""
    if data.mixture:
        return [
            (_one_source(path, data=data, key=f"data.mixture[{i}]"), w) for i, (path, w) in enumerate(parse_mixture(list(data.mixture)))
        ]
    if data.path:
        return [(file_source(data.path, text_key=data.text_key), 1.0)]
    if data.source == DataSource.FILES:
        raise UserError(
            [
                Problem(
                    "data.path",
                    None,
                    "data.source=files needs data.path",
                    "set data.path=FILE_OR_FOLDER, or data=builtin for the built-in corpus",
                )
            ]
        )
    if data.source != DataSource.BUILTIN:
        raise UserError([Problem("data.source", data.source, "unknown data source", "use builtin or files")])
    return [(builtin_source(max_mb=data.builtin_max_mb), 1.0)]


def _one_source(path: str, *, data: DataConfig, key: str) -> Source:
    if path == "builtin":
        return builtin_source(max_mb=data.builtin_max_mb)
    return file_source(path, text_key=data.text_key, key=key)


def request_spec(data: DataConfig, *, inputs: Sequence[tuple[Source, float]], vocab_size: int) -> dict:
    """What identifies a preparation (the cache key); mixture weights are not part of it."""
    tokenizer = str(Path(data.tokenizer).expanduser().resolve()) if data.tokenizer else f"bpe:{vocab_size}"
    return {"format": cache.FORMAT_VERSION, "sources": [s.spec for s, _ in inputs], "tokenizer": tokenizer, "vocab_size": vocab_size}


def _fingerprint_inputs(root: Path, inputs: Sequence[tuple[Source, float]], *, tokenizer: str | None) -> list[dict]:
    old = cache.read_manifest(root) or {}
    previous = {f["path"]: f for f in old.get("inputs", [])}
    infos: list[FileInfo] = []
    for source, _ in inputs:
        infos.extend(source.fingerprint(previous=previous))
        if source.kind == "hub":
            infos.append(_hub_fingerprint(source, root=root))
    if tokenizer:
        path = Path(tokenizer).expanduser()
        if path.is_file():
            infos.append(fingerprint_file(path.resolve(), previous=previous.get(str(path.resolve()))))
    return [i.to_json() for i in infos]


def _hub_fingerprint(source: Source, *, root: Path) -> FileInfo:
    text_key = source.spec.split("|")[2]
    docs = open_documents(source, text_key=text_key, cache_dir=root.parent.parent)
    return FileInfo(path=f"hub:{source.spec}", size=docs.num_rows, mtime_ns=0, sha256=docs.fingerprint())


def from_manifest(root: Path, manifest: dict, *, weights: Sequence[float], reused: bool) -> PreparedData:
    """A PreparedData view of a cache entry."""
    streams = tuple(
        StreamInfo(
            name=s["name"],
            folder=root / s["folder"],
            weight=float(w),
            num_tokens=s["num_tokens"],
            num_documents=s["num_documents"],
            shards=tuple((x["file"], x["tokens"]) for x in s["shards"]),
        )
        for s, w in zip(manifest["streams"], weights, strict=False)
    )
    tok = manifest["tokenizer"]
    content = cache.digest([tok["sha256"], [[s.num_tokens, s.num_documents] for s in streams]])
    return PreparedData(
        root=root,
        tokenizer_path=root / cache.TOKENIZER,
        vocab_size=tok["vocab_size"],
        eos_id=tok["eos_id"],
        num_tokens=sum(s.num_tokens for s in streams),
        dtype=manifest["dtype"],
        streams=streams,
        fingerprint=content[:16],
        reused=reused,
    )
