"""Build one cache entry: tokenizer, token shards per stream, manifest contents."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from rich.text import Text

from llmforge.config.schema import DataConfig
from llmforge.data import cache
from llmforge.data.documents import Documents, open_documents
from llmforge.data.shards import pack
from llmforge.data.sources import Source
from llmforge.data.tokenizer import cap_runs, find_eos, load_tokenizer, token_dtype, train_bpe, vocab_size_of
from llmforge.errors import Problem, UserError
from llmforge.files import sha256_file

TOKENIZER_TRAIN_BYTES = 256_000_000  # text used to train the tokenizer, spread evenly over the corpus


def build(folder: Path, *, inputs: list[Source], data: DataConfig, vocab_size: int, console=None) -> dict:
    """Write tokenizer.json and streams/<i>/ into folder; return the manifest (without inputs)."""
    cache_dir = Path(data.cache_dir).expanduser()
    tables = [open_documents(s, text_key=data.text_key, cache_dir=cache_dir) for s in inputs]
    for docs in tables:
        _check_not_empty(docs)
    tokenizer = _tokenizer(tables, data=data, vocab_size=vocab_size, console=console)
    tokenizer_path = folder / cache.TOKENIZER
    tokenizer.save(str(tokenizer_path))
    eos_id = find_eos(tokenizer)
    dtype = token_dtype(vocab_size_of(tokenizer))
    streams = []
    for i, docs in enumerate(tables):
        stats = _pack_one(
            docs,
            folder=folder / "streams" / str(i),
            tokenizer_path=tokenizer_path,
            eos_id=eos_id,
            dtype=dtype,
            num_proc=data.num_proc,
            console=console,
        )
        if stats.num_documents == 0:
            raise UserError(
                [
                    Problem(
                        "data.path", docs.source.spec.split("|")[1], "every document is empty", "check data.text_key and the file contents"
                    )
                ],
                title="no text in the data",
            )
        streams.append(
            {
                "name": docs.source.name,
                "folder": f"streams/{i}",
                "source": docs.source.spec,
                "num_tokens": stats.num_tokens,
                "num_documents": stats.num_documents,
                "skipped_empty": stats.skipped_empty,
                "skipped_files": list(docs.source.skipped),
                "shards": stats.shards,
            }
        )
        _warn_skips(console, docs, stats.skipped_empty)
    tok_info = {
        "sha256": sha256_file(tokenizer_path),
        "vocab_size": vocab_size_of(tokenizer),
        "eos_id": eos_id,
        "trained": data.tokenizer is None,
        "source": data.tokenizer,
    }
    return {
        "format": cache.FORMAT_VERSION,
        "tokenizer": tok_info,
        "dtype": dtype.name,
        "streams": streams,
        "num_tokens": sum(s["num_tokens"] for s in streams),
    }


def _check_not_empty(docs: Documents) -> None:
    if docs.num_rows == 0:
        raise UserError(
            [Problem("data.path", docs.source.spec.split("|")[1], "holds no documents", "point data.path at files with text in them")],
            title="no text in the data",
        )


def _tokenizer(tables: list[Documents], *, data: DataConfig, vocab_size: int, console):
    if data.tokenizer:
        return load_tokenizer(data.tokenizer, vocab_size=vocab_size)
    budget = TOKENIZER_TRAIN_BYTES // len(tables)
    title = f"Training a byte-level BPE tokenizer ({vocab_size} tokens)"
    status = console.status(title) if console else nullcontext()
    with status:
        report = (lambda note: status.update(f"{title}: {note}")) if console else None
        return train_bpe(_training_text(tables, budget=budget, report=report), vocab_size=vocab_size)


def _training_text(tables: list[Documents], *, budget: int, report: Callable[[str], None] | None = None):
    """Evenly spaced batches of every table, about budget bytes from each, long runs cut (cap_runs).
    ``report`` hears how much text was read, then that the merges are being computed."""
    read = 0
    for docs in tables:
        total = sum(Path(f).stat().st_size for f in docs.source.files) or budget
        batch = max(1, min(1024, docs.num_rows // 64 or 1))
        stride = max(1, math.ceil(total / budget))
        for texts in docs.batches(batch_size=batch, stride=stride):
            pieces = [piece for t in texts if t for piece in cap_runs(t)]
            read += sum(len(p) for p in pieces)
            if report is not None:
                report(f"{read / 1e6:.1f} M characters read")
            yield pieces
    if report is not None:
        report(f"{read / 1e6:.1f} M characters read, computing the merges")


def _pack_one(docs: Documents, *, folder: Path, tokenizer_path: Path, eos_id: int, dtype, num_proc: int, console):
    if console is None:
        return pack(docs, tokenizer_path=tokenizer_path, eos_id=eos_id, dtype=dtype, out_dir=folder, num_proc=num_proc)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("documents"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"Tokenizing {docs.source.name}", total=docs.num_rows)
        return pack(
            docs,
            tokenizer_path=tokenizer_path,
            eos_id=eos_id,
            dtype=dtype,
            out_dir=folder,
            num_proc=num_proc,
            progress=lambda n: progress.advance(task, n),
        )


def _warn_skips(console, docs: Documents, skipped_empty: int) -> None:
    notes = list(docs.source.skipped)
    if skipped_empty:
        notes.append(f"{skipped_empty} empty document(s)")
    if not notes:
        return
    if console is None:
        warnings.warn(f"skipped in {docs.source.name}: " + "; ".join(notes[:5]), stacklevel=3)
    else:
        console.print(
            Text.assemble(
                ("warning:", "yellow"),
                f" skipped in {docs.source.name}: {len(notes)} item(s): " + "; ".join(notes[:5]) + (" ..." if len(notes) > 5 else ""),
            )
        )
