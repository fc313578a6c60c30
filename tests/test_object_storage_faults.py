"""Object-storage checkpoints under faults, on moto's S3 server on localhost, without training:
a stored object whose bytes changed but not its size is caught by its SHA-256, and a removal
cut short leaves no step that still counts as complete."""

from __future__ import annotations

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from test_object_storage import s3  # noqa: E402, F401  (the module's moto server fixture)

from llmforge.checkpoint import objstore  # noqa: E402
from llmforge.errors import UserError  # noqa: E402


def _checkpoint(prefix: str, *, step: int) -> None:
    """A published checkpoint of a few small objects (its manifest written last)."""
    fs = objstore.filesystem(prefix)
    fs.pipe_file(f"{prefix}/__0_0.distcp", b"shard bytes of step %d" % step)
    fs.pipe_file(f"{prefix}/.metadata", b"metadata")
    objstore.write_json(f"{prefix}/plan.json", {"config": {}})
    objstore.write_json(f"{prefix}/train_state.json", {"step": step})
    objstore.write_manifest(prefix, step=step)


def test_bytes_changed_in_place_are_caught_by_their_sha256(s3):  # noqa: F811
    _checkpoint("s3://bucket/sha/step_1", step=1)
    objstore.verify("s3://bucket/sha/step_1", checksums=True)
    objstore.filesystem("s3://bucket").pipe_file("bucket/sha/step_1/__0_0.distcp", b"shard bytes of step 9")  # the same size
    with pytest.raises(UserError, match="__0_0.distcp: checksum mismatch"):
        objstore.verify("s3://bucket/sha/step_1", checksums=True)
    objstore.verify("s3://bucket/sha/step_1", checksums=False)  # sizes alone cannot see it


def test_a_rotation_cut_short_leaves_no_half_removed_step_that_counts_as_complete(s3, monkeypatch):  # noqa: F811
    for step in (1, 2, 3):
        _checkpoint(f"s3://bucket/rot/step_{step}", step=step)
    fs = objstore.filesystem("s3://bucket")

    def interrupted(path, recursive=False, **kwargs):
        raise KeyboardInterrupt  # a Ctrl-C or a lost connection between the removals

    monkeypatch.setattr(fs, "rm", interrupted)  # fsspec caches the instance: every removal goes through it
    with pytest.raises(KeyboardInterrupt):
        objstore.rotate("s3://bucket/rot", keep=2)
    monkeypatch.undo()
    assert [objstore.step_of(u) for u in objstore.complete("s3://bucket/rot")] == [3, 2]  # step_1 stopped counting first
    objstore.clear_stale("s3://bucket/rot")  # the next save removes what the cut-short removal left
    assert objstore.children("s3://bucket/rot") == ["s3://bucket/rot/step_2", "s3://bucket/rot/step_3"]
