"""What a ``data.text_key`` column holds when it is not all text: the value types found
and the first file and row with a value that is not a string, for the error message.

Only read on that error path; imports neither torch nor datasets.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

#: Rows read per file at most when looking for the value types.
_MAX_ROWS = 1_000_000
_JSON_NAMES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "NoneType": "null",
    "list": "list",
    "dict": "object",
}


def describe_non_text(files: list[str], *, kind: str, text_key: str) -> str | None:
    """'FILE: column 'text' holds int and str values (row 2: 5)', or None if nothing was found."""
    for name in files:
        found = _parquet_type(Path(name), text_key) if kind == "parquet" else _json_types(Path(name), text_key)
        if found is not None:
            types, where = found
            return f"{name}: column '{text_key}' holds {' and '.join(sorted(types))} values ({where})"
    return None


def _json_types(path: Path, text_key: str) -> tuple[set[str], str] | None:
    """The value types of ``text_key`` in a .jsonl (or .json array) file and its first non-string row."""
    types: set[str] = set()
    first = ""
    for row, value in _json_values(path, text_key):
        types.add(_JSON_NAMES.get(type(value).__name__, type(value).__name__))
        if not first and not isinstance(value, str):
            first = f"the first that is not a string: row {row}, {json.dumps(value)[:40]}"
    return (types, first) if first else None


def _json_values(path: Path, text_key: str) -> Iterator[tuple[int, object]]:
    with path.open(encoding="utf-8", errors="replace") as fh:
        head = fh.read(1)
        fh.seek(0)
        if head == "[":  # one JSON array of records
            rows = json.load(fh)
            yield from ((i, r.get(text_key)) for i, r in enumerate(rows[:_MAX_ROWS], 1) if isinstance(r, dict))
            return
        for i, line in enumerate(fh, 1):
            if i > _MAX_ROWS:
                return
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield i, record.get(text_key)


def _parquet_type(path: Path, text_key: str) -> tuple[set[str], str] | None:
    """The Arrow type of a parquet file's ``text_key`` column, if it is not a string type."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if text_key not in schema.names:
        return None
    kind = str(schema.field(text_key).type)
    return None if kind in ("string", "large_string") else ({kind}, "the file's schema")
