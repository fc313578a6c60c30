"""Read a resolved source as a table of documents with `datasets` (Arrow, memory-mapped).

.txt files become one document per file; .jsonl and .parquet files one document per row
(the ``data.text_key`` column). The built-in corpus is one document per standard-library
file. Nothing is downloaded: the Hugging Face libraries are put in offline mode first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmforge.data.sources import Source, check_utf8
from llmforge.data.text_column import describe_non_text
from llmforge.errors import Problem, UserError

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Documents:
    """A column of document texts, read in batches."""

    table: object  # datasets.Dataset with a single "text" column
    source: Source

    @property
    def num_rows(self) -> int:
        return len(self.table)

    def batches(self, *, batch_size: int, stride: int = 1) -> Iterator[list[str]]:
        """Batches of document texts in order; stride > 1 keeps every stride-th batch only."""
        for i, start in enumerate(range(0, self.num_rows, batch_size)):
            if i % stride == 0:
                yield self.table[start : start + batch_size]["text"]

    def fingerprint(self) -> str:
        """The datasets fingerprint (used for hub datasets, which have no files of ours)."""
        return str(getattr(self.table, "_fingerprint", ""))


def open_documents(source: Source, *, text_key: str, cache_dir: Path) -> Documents:
    """Load a source into a Documents table, turning every user mistake into a UserError."""
    datasets = _quiet_datasets()
    if source.kind == "builtin":
        texts = [Path(f).read_text(encoding="utf-8") for f in source.files]
        return Documents(datasets.Dataset.from_dict({"text": texts}), source)
    if source.kind in ("text", "json"):
        for f in source.files:
            check_utf8(Path(f))
    table = _load(datasets, source, text_key=text_key, cache_dir=cache_dir)
    return Documents(_text_column(table, source, text_key=text_key), source)


def _load(datasets, source: Source, *, text_key: str, cache_dir: Path):
    hf_cache = str(cache_dir / "hf")
    try:
        if source.kind == "hub":
            name = source.spec.split("|")[1]
            return datasets.load_dataset(name, split="train")
        builder = {"text": "text", "json": "json", "parquet": "parquet"}[source.kind]
        extra = {"sample_by": "document"} if builder == "text" else {}
        return datasets.load_dataset(builder, data_files=list(source.files), split="train", cache_dir=hf_cache, **extra)
    except UserError:
        raise
    except Exception as exc:  # datasets wraps parser errors in several exception types
        raise _load_error(source, exc) from None


def _load_error(source: Source, exc: Exception) -> UserError:
    cause = exc
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    where = source.spec.split("|")[1]
    if source.kind == "hub":
        return UserError(
            [
                Problem(
                    "data.path",
                    where,
                    "not a file or folder, and not a dataset in the local Hugging Face cache (nothing is downloaded)",
                    "point data.path at local .txt/.jsonl/.parquet files",
                )
            ],
            title="missing data",
        )
    return UserError(
        [
            Problem(
                "data.path",
                where,
                f"could not be read as {source.kind} ({type(cause).__name__}: {str(cause)[:200]})",
                "fix the file's syntax or remove it from the folder",
            )
        ],
        title="unreadable data file",
    )


def _text_column(table, source: Source, *, text_key: str):
    if hasattr(table, "keys") and not hasattr(table, "column_names"):
        table = table[next(iter(table.keys()))]
    columns = list(table.column_names)
    if source.kind == "text":
        return table
    if text_key not in columns:
        where = source.spec.split("|")[1]
        raise UserError(
            [
                Problem(
                    "data.text_key", text_key, f"{where} has no such column (columns: {columns})", f"set data.text_key to one of {columns}"
                )
            ],
            title="missing text column",
        )
    dtype = str(table.features[text_key].dtype) if hasattr(table.features[text_key], "dtype") else ""
    if dtype not in ("string", "large_string"):
        found = describe_non_text(list(source.files), kind=source.kind, text_key=text_key)
        holds = found or f"column '{text_key}' holds {dtype or table.features[text_key]} values"
        raise UserError(
            [
                Problem(
                    "data.text_key",
                    text_key,
                    f"{holds}; every value must be a string",
                    "make every value of the column a string, or set data.text_key to a column of strings",
                )
            ],
            title="wrong text column",
        )
    table = table.select_columns([text_key])
    return table.rename_column(text_key, "text") if text_key != "text" else table


def _quiet_datasets():
    import datasets

    datasets.config.HF_HUB_OFFLINE = True  # in case datasets was imported before the environment was set
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


def split_long(text: str, *, max_chars: int) -> list[str]:
    """Cut a long document before line breaks that follow a non-space character.

    No byte-level pre-token spans such a point and none depends on what lies beyond it,
    so the pieces tokenize exactly like the whole document and spread over the
    tokenizer's worker threads. Text without such a point is cut anyway (it still decodes exactly).
    """
    if len(text) <= max_chars:
        return [text]
    pieces: list[str] = []
    start = 0
    while len(text) - start > max_chars:
        cut = _cut_point(text, start=start, max_chars=max_chars)
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _cut_point(text: str, *, start: int, max_chars: int) -> int:
    pos = start + max_chars
    while True:
        nl = text.rfind("\n", start + 1, pos)
        if nl < 0:
            return start + max_chars
        if not text[nl - 1].isspace():
            return nl
        pos = nl
