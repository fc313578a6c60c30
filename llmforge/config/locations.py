"""Where a plan writes and reads, checked before anything runs.

Only checkpoints may go to object storage, and only to a store that outlives the run and
names a bucket. Every other location (the run folder, the data, the tokenizer, the data
cache, the weights to start from) is a local path: a URL there, or a path a URL's ``//``
was folded into (``s3:/bucket/x``), would be read or written as a local look-alike folder,
so it is refused. The run folder and the data keep apart: a run writing its plan, metrics
and checkpoints into its own corpus could never be resumed.

This module imports no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmforge.config.schema import RunConfig
from llmforge.errors import Problem
from llmforge.storage import LOCAL_PROTOCOLS, basename, is_url, looks_like_url, not_a_local_path, url_problem


def location_problems(config: RunConfig) -> list[Problem]:
    """Every location of ``config`` that cannot be used as given."""
    return [*_run_dir_problems(config), *_checkpoint_dir_problems(config), *_local_problems(config), *_data_overlap_problems(config)]


def _run_dir_problems(config: RunConfig) -> list[Problem]:
    """run.dir is a local folder (lock, plan, metrics); only checkpoints may go to object storage."""
    where = config.run.dir
    if is_url(where):
        return [
            Problem(
                "run.dir",
                where,
                "must be a local folder (it holds the run's lock, plan.json and metrics.jsonl)",
                f"set run.dir to a local folder and checkpoint.dir={where} to put the checkpoints in object storage",
            )
        ]
    rule = not_a_local_path(where)
    if rule:
        fix = f"set run.dir to a local folder, e.g. run.dir={_local_url(where) or 'runs/' + _safe_name(config.run.name)}"
        return [Problem("run.dir", where, rule, fix)]
    return []


def _checkpoint_dir_problems(config: RunConfig) -> list[Problem]:
    where = config.checkpoint.dir
    if where is None:
        return []
    if not is_url(where):
        return [
            Problem(
                "checkpoint.dir",
                where,
                "is not an object-storage URL",
                "leave it unset to keep checkpoints in run.dir/checkpoints, or give a URL such as s3://BUCKET/PREFIX",
            )
        ]
    refused = url_problem(where, key="checkpoint.dir")
    return [Problem("checkpoint.dir", where, *refused)] if refused else []


def _local_paths(config: RunConfig) -> list[tuple[str, str]]:
    """(key, path) of every location read or written as a local path, besides run.dir."""
    d = config.data
    found = [
        ("data.path", d.path),
        ("data.tokenizer", d.tokenizer),
        ("data.cache_dir", d.cache_dir),
        ("model.init_from", config.model.init_from),
    ]
    found += [(f"data.mixture[{i}]", mixture_path(entry)) for i, entry in enumerate(d.mixture)]
    return [(key, str(value)) for key, value in found if value]


def mixture_path(entry: object) -> str:
    """The PATH of a data.mixture entry ``PATH:WEIGHT``."""
    path, sep, _ = str(entry).rpartition(":")
    return path if sep else str(entry)


def _local_problems(config: RunConfig) -> list[Problem]:
    out = []
    for key, value in _local_paths(config):
        rule = not_a_local_path(value)
        if not rule:
            continue
        local = f"data/{_safe_name(basename(value))}"
        if _local_url(value):
            fix = f"give the path itself, e.g. {key}={_local_url(value)}"
        elif key == "data.cache_dir":
            fix = "leave it unset (~/.cache/llmforge) or give a local folder, e.g. data.cache_dir=data/cache"
        elif key.startswith("data.mixture"):
            fix = f"copy it to this machine first and list the copy in data.mixture, e.g. data.mixture=[{local}:1]"
        else:
            fix = f"copy it to this machine first and point {key} at the copy, e.g. {key}={local}"
        out.append(Problem(key, value, rule, fix))
    return out


def _local_url(value: str) -> str:
    """The path of a ``file://`` or ``local://`` URL ('' for anything else)."""
    head, sep, rest = value.partition("://")
    return rest if sep and head.lower() in LOCAL_PROTOCOLS and rest else ""


def _safe_name(text: str) -> str:
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-.")
    return name or "run"


def _data_overlap_problems(config: RunConfig) -> list[Problem]:
    """run.dir equal to, inside, or holding a data path: the run would write into its corpus."""
    if is_url(config.run.dir) or looks_like_url(config.run.dir):
        return []
    run_dir = _absolute(config.run.dir)
    data = [(key, value) for key, value in _local_paths(config) if key == "data.path" or key.startswith("data.mixture")]
    data = [(key, value) for key, value in data if not looks_like_url(value)]
    clashes = [(key, value) for key, value in data if _overlap(run_dir, _absolute(value))]
    if not clashes:
        return []
    suggestion = _run_dir_apart(config, [_absolute(value) for _, value in data])
    return [
        Problem(
            "run.dir",
            config.run.dir,
            f"{_relation(run_dir, _absolute(value))} {key}={value}: the run would write its plan, metrics and checkpoints among its data",
            f"keep the run folder apart from the data, e.g. run.dir={suggestion}",
        )
        for key, value in clashes
    ]


def _absolute(path: str) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _relation(run_dir: Path, data: Path) -> str:
    if run_dir == data:
        return "is"
    return "is inside" if data in run_dir.parents else "holds"


def _run_dir_apart(config: RunConfig, data: list[Path]) -> str:
    """A run folder beside the outermost data path (so inside none of them) that holds none of them."""
    outermost = min(data, key=lambda p: len(p.parts))
    base = outermost.parent / f"{outermost.name}-runs"
    for n in range(1, 100):
        candidate = base / _safe_name(config.run.name) if n == 1 else base / f"{_safe_name(config.run.name)}-{n}"
        if not any(_overlap(candidate, d) for d in data):
            return str(candidate)
    return str(base)
