"""Where a plan writes and reads: checkpoints only in a store that outlives the run and names a
bucket, every other location local (no URL, no URL folded into ``s3:/...``), the run folder
apart from its data; each refusal's example value is accepted when pasted (plans only, no torch)."""

from __future__ import annotations

import re

import pytest

from llmforge.config.compose import compose
from llmforge.errors import UserError
from llmforge.plan import RunPlan


def refused(overrides: list[str]) -> UserError:
    with pytest.raises(UserError) as info:
        RunPlan.build(compose(overrides))
    return info.value


def pasted_example(error: UserError, key: str) -> str:
    """The ``key=value`` the first problem's fix gives as its example."""
    fix = error.problems[0].fix
    match = re.search(rf"{re.escape(key)}=(\S+)", fix)
    assert match, fix
    return f"{key}={match.group(1).rstrip(',;')}"


@pytest.mark.parametrize(
    "override, key, says",
    [
        ("checkpoint.dir=s3://", "checkpoint.dir", "names no bucket after s3://"),
        ("checkpoint.dir=s3:///run", "checkpoint.dir", "names no bucket after s3://"),
        ("checkpoint.dir=memory://x/run", "checkpoint.dir", "vanish when the run ends"),
        ("checkpoint.dir=local://x/run", "checkpoint.dir", "is not an object-storage URL"),
        ("run.dir=s3:/bucket/run", "run.dir", "folded into one slash"),
        ("run.dir=s3://bucket/run", "run.dir", "must be a local folder"),
        ("data.path=s3://bucket/corpus", "data.path", "is a URL, and only checkpoint.dir may be in object storage"),
        ("data.path=file:///srv/corpus", "data.path", "is a file:// URL"),
        ("run.dir=file:///srv/runs/x", "run.dir", "is a file:// URL"),
        ("data.cache_dir=gs://bucket/cache", "data.cache_dir", "is a URL"),
        ("data.tokenizer=s3:/bucket/tokenizer.json", "data.tokenizer", "folded into one slash"),
        ("model.init_from=s3://bucket/hf", "model.init_from", "is a URL"),
        ("data.mixture=[s3://bucket/web:1]", "data.mixture[0]", "is a URL"),
    ],
)
def test_a_location_that_would_be_lost_or_a_local_look_alike_is_refused(override, key, says):
    error = refused([override])
    assert [p.key for p in error.problems] == [key] and says in error.problems[0].rule, error.message()


@pytest.mark.parametrize(
    "override, key",
    [
        ("checkpoint.dir=s3://", "checkpoint.dir"),
        ("run.dir=s3:/bucket/run", "run.dir"),
        ("data.cache_dir=gs://bucket/cache", "data.cache_dir"),
        ("data.path=s3://bucket/corpus", "data.path"),
        ("run.dir=file:///srv/runs/x", "run.dir"),
    ],
)
def test_the_example_of_a_location_fix_is_accepted(override, key):
    RunPlan.build(compose([pasted_example(refused([override]), key)]))


@pytest.mark.parametrize(
    "run_dir, data, relation", [("corpus", "corpus", "is"), ("corpus/run", "corpus", "is inside"), (".", "corpus", "holds")]
)
def test_run_dir_overlapping_its_data_is_refused_and_the_example_is_not(tmp_path, monkeypatch, run_dir, data, relation):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    for given in ([f"data.path={data}"], [f"data.mixture=[{data}:1]"]):
        error = refused([f"run.dir={run_dir}", *given])
        assert error.problems[0].key == "run.dir" and error.problems[0].rule.startswith(f"{relation} data."), error.message()
        RunPlan.build(compose([pasted_example(error, "run.dir"), *given]))
    RunPlan.build(compose(["run.dir=runs/apart", "data.path=corpus"]))
