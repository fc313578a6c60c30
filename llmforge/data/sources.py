"""Where the text comes from: the built-in corpus, the user's files, or a cached dataset.

A *source* is resolved once into a list of files with their fingerprints (size, mtime
and a SHA-256 of the bytes). The fingerprints go into the manifest of the prepared data,
so a later run can tell whether its cache still matches the input.

This module imports neither torch nor datasets.
"""

from __future__ import annotations

import codecs
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from llmforge.errors import Problem, UserError
from llmforge.files import sha256_file

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileInfo:
    """One input file as recorded in the manifest."""

    path: str
    size: int
    mtime_ns: int
    sha256: str

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns, "sha256": self.sha256}


@dataclass(frozen=True)
class Source:
    """A resolved dataset: what kind, which files, and the identity used for its cache key."""

    kind: str  # "builtin", "text", "json", "parquet" or "hub"
    files: tuple[str, ...]
    spec: str  # stable description of the user's request (cache key input)
    name: str  # short human name for cache folders and summaries
    skipped: tuple[str, ...] = ()  # files left out, with the reason

    def fingerprint(self, *, previous: dict | None = None) -> list[FileInfo]:
        """Fingerprint every file, reusing a previous hash when size and mtime are unchanged."""
        previous = previous or {}
        return [fingerprint_file(Path(f), previous=previous.get(f)) for f in self.files]


def fingerprint_file(path: Path, *, previous: dict | None = None) -> FileInfo:
    """Size, mtime and SHA-256 of a file; the hash is reused when size and mtime match."""
    st = path.stat()
    if previous and previous.get("size") == st.st_size and previous.get("mtime_ns") == st.st_mtime_ns:
        return FileInfo(str(path), st.st_size, st.st_mtime_ns, previous["sha256"])
    return FileInfo(str(path), st.st_size, st.st_mtime_ns, sha256_file(path))


def check_utf8(path: Path) -> None:
    """Raise a UserError naming the file and the byte offset if it is not valid UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_READ_CHUNK), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                _raise_not_utf8(path, offset + exc.start)
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        _raise_not_utf8(path, offset)


def _raise_not_utf8(path: Path, offset: int) -> None:
    raise UserError(
        [
            Problem(
                key="data.path",
                value=str(path),
                rule=f"byte {offset} is not valid UTF-8",
                fix=f"convert the file to UTF-8 (for example: iconv -f latin1 -t utf-8 {path} > fixed.txt)",
            )
        ],
        title="unreadable data file",
    )


def builtin_source(*, max_mb: float) -> Source:
    """The standard library's own .py files, library modules before tests, up to max_mb."""
    if max_mb <= 0:
        raise UserError([Problem("data.builtin_max_mb", max_mb, "must be positive", "set data.builtin_max_mb=8")])
    root = Path(sysconfig.get_paths()["stdlib"])
    budget = int(max_mb * 1_000_000)
    chosen: list[str] = []
    skipped: list[str] = []
    total = 0
    for path in sorted(_stdlib_files(root), key=lambda p: (_is_test(p, root), str(p))):
        size = path.stat().st_size
        if size == 0:
            continue
        if not _is_utf8(path):
            skipped.append(f"{path}: not UTF-8")
            continue
        chosen.append(str(path))
        total += size
        if total >= budget:
            break
    if not chosen:
        raise UserError(f"no Python standard library sources found under {root}; set data.path to your own text files")
    spec = f"builtin|python={sys.version_info[0]}.{sys.version_info[1]}|root={root}|max_mb={max_mb}"
    return Source(kind="builtin", files=tuple(chosen), spec=spec, name="builtin", skipped=tuple(skipped))


def _stdlib_files(root: Path) -> list[Path]:
    found: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        found.extend(Path(folder) / n for n in names if n.endswith(".py"))
    return found


def _is_test(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).parts
    return any(p in ("test", "tests", "idle_test") for p in parts) or path.name.startswith("test_")


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def file_source(path_text: str, *, text_key: str, key: str = "data.path") -> Source:
    """Resolve data.path (a file, a folder of files, or a dataset name in the local cache)."""
    path = Path(path_text).expanduser()
    if path.is_dir():
        return _folder_source(path.resolve(), text_key=text_key, key=key)
    if path.is_file():
        path = path.resolve()
        kind = _kind_of(path, key=key)
        if path.stat().st_size == 0:
            raise UserError(
                [Problem(key, str(path), "the file is empty", "point data.path at a file with text in it")], title="empty data file"
            )
        return Source(kind=kind, files=(str(path),), spec=f"{kind}|{path}|{text_key}", name=_slug(path.stem))
    if path.exists():
        raise UserError(
            [
                Problem(
                    key,
                    path_text,
                    "is neither a regular file nor a folder (a device, pipe or socket)",
                    f"point {key} at a .txt, .jsonl or .parquet file or a folder of them",
                )
            ],
            title="unreadable data file",
        )
    if _looks_like_hub_name(path_text):
        return Source(kind="hub", files=(), spec=f"hub|{path_text}|{text_key}", name=_slug(path_text))
    raise UserError(
        [
            Problem(
                key, path_text, "no such file or folder", f"point {key} at an existing .txt, .jsonl or .parquet file or a folder of them"
            )
        ],
        title="missing data file",
    )


def _folder_source(folder: Path, *, text_key: str, key: str) -> Source:
    every = sorted(p for p in folder.rglob("*") if p.is_file())
    files = [p for p in every if p.suffix.lower() in SUPPORTED]
    others = _unsupported([p for p in every if p.suffix.lower() not in SUPPORTED], folder=folder)
    if not files:
        holds = f" (it holds {others[0]})" if others else ""
        raise UserError(
            [
                Problem(
                    key,
                    str(folder),
                    f"the folder holds no .txt, .md, .jsonl, .json or .parquet files{holds}",
                    "add data files to it or point data.path at another folder",
                )
            ],
            title="empty data folder",
        )
    kinds = {_kind_of(p, key=key) for p in files}
    if len(kinds) > 1:
        raise UserError(
            [
                Problem(
                    key,
                    str(folder),
                    f"the folder mixes formats ({', '.join(sorted(kinds))})",
                    "keep one format per folder and combine folders with data.mixture=[A:1,B:1]",
                )
            ],
            title="mixed data formats",
        )
    kept = [p for p in files if p.stat().st_size > 0]
    skipped = tuple(f"{p}: empty file" for p in files if p.stat().st_size == 0) + tuple(others)
    if not kept:
        raise UserError(
            [Problem(key, str(folder), "every data file in the folder is empty", "add text to the files or point data.path elsewhere")],
            title="empty data folder",
        )
    kind = kinds.pop()
    return Source(
        kind=kind, files=tuple(str(p) for p in kept), spec=f"{kind}|{folder}/|{text_key}", name=_slug(folder.name), skipped=skipped
    )


def _unsupported(paths: list[Path], *, folder: Path) -> list[str]:
    """One note naming the files a folder holds besides data files (none if there are none)."""
    if not paths:
        return []
    names = ", ".join(str(p.relative_to(folder)) for p in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return [f"{len(paths)} file(s) of a type llmforge does not read ({names}; it reads {' '.join(SUPPORTED)})"]


def _kind_of(path: Path, *, key: str) -> str:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise UserError(
        [Problem(key, str(path), f"unsupported file type {suffix or '(none)'}", "use .txt, .md, .jsonl, .json or .parquet files")],
        title="unsupported data file",
    )


def _looks_like_hub_name(text: str) -> bool:
    if text.startswith((".", "/", "~")) or Path(text).suffix.lower() in SUPPORTED:
        return False
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(p and all(c.isalnum() or c in "-_." for c in p) for p in parts)


def _slug(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_" else "-" for c in text).strip("-")
    return cleaned[:40] or "data"


def parse_mixture(entries: list[str]) -> list[tuple[str, float]]:
    """Split data.mixture entries "PATH:WEIGHT" into (path, weight) pairs, collecting every problem."""
    pairs: list[tuple[str, float]] = []
    problems: list[Problem] = []
    for i, entry in enumerate(entries):
        path, sep, weight_text = str(entry).rpartition(":")
        try:
            weight = float(weight_text) if sep else float("nan")
        except ValueError:
            weight = float("nan")
        if not sep or not path or not weight > 0 or weight == float("inf"):
            problems.append(
                Problem(
                    f"data.mixture[{i}]",
                    entry,
                    "expected PATH:WEIGHT with a positive weight",
                    "write entries like data.mixture=[data/web:0.7,data/code:0.3]",
                )
            )
            continue
        pairs.append((path, weight))
    if problems:
        raise UserError(problems, title="invalid data mixture")
    return pairs
