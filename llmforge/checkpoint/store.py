"""Save and load training state with torch.distributed.checkpoint (DCP).

A checkpoint is a folder ``checkpoints/step_N/`` holding

- DCP's shards and ``.metadata``: model and optimizer tensors by parameter name,
- ``train_state.json``: step, LR scheduler, data sampler, loss scaler,
- ``rng/rank_*.json``: every rank's RNG states,
- ``plan.json``: the plan the run was saved with,
- ``manifest.json``: every file's size and SHA-256, written last.

It is written into ``.tmp-step_N`` and renamed to ``step_N`` by rank 0 once every
rank's shards are on disk, so a killed save never leaves a folder that looks
complete. With ``async_save`` the tensors are copied off the device (the only
stall) and written, checksummed and renamed in the background.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from llmforge.checkpoint import objstore
from llmforge.checkpoint.failures import first_line as _first_line
from llmforge.checkpoint.failures import interruption, save_failure
from llmforge.checkpoint.failures import os_error as _os_error
from llmforge.checkpoint.manifest import MANIFEST, read_train_state, verify, write_manifest
from llmforge.checkpoint.owner import check_at_save
from llmforge.checkpoint.safe_reader import load_metadata, safe_reader
from llmforge.checkpoint.state import apply_model_state, save_rng, tensor_state
from llmforge.errors import Problem, UserError, fail, pasteable
from llmforge.files import fsync_dir, write_json_atomic
from llmforge.models.fused import unfused_parts
from llmforge.storage import is_url, join, storage_error

TRAIN_STATE = "train_state.json"
PLAN = "plan.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
TIED_HEAD = "model.head.weight"


#: A checkpoint location: a local folder, or an object-storage URL (``s3://bucket/run``, see ``objstore``).
Where = Any


def step_dirs(root: Where) -> list[Where]:
    """``step_N`` folders under a checkpoints folder, newest first (complete or not)."""
    if is_url(root):
        return objstore.step_dirs(root)  # type: ignore[return-value]
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), reverse=True)  # type: ignore[union-attr]


def complete(root: Where) -> list[Where]:
    """Step folders that carry a manifest, newest first."""
    if is_url(root):
        return objstore.complete(root)  # type: ignore[return-value]
    return [p for p in step_dirs(root) if (p / MANIFEST).is_file()]


def step_of(path: Where) -> int:
    """N of a ``step_N`` folder."""
    if is_url(path):
        return objstore.step_of(path)
    return int(_STEP_DIR.match(path.name).group(1))  # type: ignore[union-attr]


def newest_before(root: Where, *, step: int) -> Where | None:
    """The newest complete checkpoint saved before ``step``, or None."""
    return next((p for p in complete(root) if step_of(p) < step), None)


def rotate(root: Where, *, keep: int, protect: Iterable[int] = ()) -> list[Where]:
    """Remove complete checkpoints beyond the ``keep`` newest (``keep`` < 1 keeps all).

    The newest complete checkpoint is never removed, nor, for each step in ``protect``
    (the first of a run of non-finite steps), the newest one saved before it. A folder is
    renamed away before it is deleted, so an interrupted removal leaves no damaged step folder."""
    if is_url(root):
        return objstore.rotate(root, keep=keep, protect=protect)  # type: ignore[return-value]
    kept = {newest_before(root, step=s) for s in protect}
    removed = []
    for old in complete(root)[max(keep, 1) :] if keep > 0 else []:
        if old in kept:
            continue
        doomed = old.with_name(f".del-{old.name}")
        old.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(old)
    return removed


def set_aside(path: Where, *, name: str) -> Where:
    """Move a checkpoint out of the ``step_N`` names (``latest`` never picks it then)."""
    if is_url(path):
        return objstore.set_aside(path, name=name)
    target = path.with_name(name)
    path.rename(target)
    return target


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group (intended here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@dataclass
class SaveRecord:
    """What one save did; ``stall_s`` is how long training waited for it."""

    step: int
    path: Path
    stall_s: float
    mode: str


class CheckpointSaver:
    """Writes checkpoints of one rank; rank 0 finalises (manifest, rename, rotation).

    ``log`` receives one line per save (rank 0 only). ``run_dir``: the run that saves, which
    must own a ``root`` in object storage (``llmforge.checkpoint.owner``; checked at every save)."""

    def __init__(
        self, *, root: Where, keep: int, async_save: bool, rank: int, log: Callable[[str], None], run_dir: Path | None = None
    ) -> None:
        self.remote = is_url(root)
        self._owner = run_dir if self.remote else None
        self.root, self.keep, self.async_save, self.rank, self.log = root if self.remote else Path(root), keep, async_save, rank, log
        self.records: list[SaveRecord] = []
        self._pending: Future | None = None
        self._pending_tmp, self._pending_step = self.root, 0
        self._protect: list[int] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmforge-ckpt") if async_save else None
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None

    def save(
        self,
        *,
        step: int,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
        plan: dict[str, Any],
        protect: Iterable[int] = (),
    ) -> Path:
        """Save step ``step``; return the folder it has (or, if async, will have). Rotation
        keeps the newest checkpoint before each step in ``protect`` (see ``rotate``)."""
        started = time.perf_counter()
        self.wait()
        self._protect = list(protect)
        final, tmp = self._folders(step)
        try:
            if self.rank == 0:
                self._start(tmp, final, state={"step": step, **train_state}, plan=plan)
            _barrier()
            save_rng(tmp, rank=self.rank)
            state = tensor_state(model_parts, optimizer)
            with quiet_single_process():
                self._write(state, tmp=tmp, final=final, step=step)
        except UserError:
            raise
        except self._failures as exc:
            raise self._failed(exc, tmp=tmp, step=step) from None
        stall = time.perf_counter() - started
        self.records.append(SaveRecord(step=step, path=final, stall_s=stall, mode="async" if self.async_save else "sync"))
        if self.rank == 0:
            self.log(f"checkpoint step {step} -> {final} ({self.records[-1].mode}): training stalled {stall:.3f}s")
        return final

    @property
    def _failures(self) -> tuple:
        # object storage backends raise their own types (botocore, aiohttp, google-auth)
        return (Exception, CheckpointException) if self.remote else (OSError, CheckpointException)  # CheckpointException is a BaseException

    def _folders(self, step: int) -> tuple[Where, Where]:
        """(final, temporary) place of step ``step``: the same prefix on object storage,
        where the manifest written last publishes it."""
        if self.remote:
            return (join(self.root, f"step_{step}"),) * 2
        return self.root / f"step_{step}", self.root / f".tmp-step_{step}"

    def _start(self, tmp: Where, final: Where, *, state: dict[str, Any], plan: dict[str, Any]) -> None:
        """Rank 0: clear leftovers, then write the JSON state and the plan."""
        if self.remote:
            if self._owner is not None:  # every save: another run may have taken the prefix over (--overwrite) meanwhile
                check_at_save(self.root, run_dir=self._owner)
            objstore.clear_stale(self.root)
            objstore.remove(final)  # the same step saved again (after a resume): unpublish the old one first
            objstore.write_json(join(tmp, TRAIN_STATE), state)
            objstore.write_json(join(tmp, PLAN), plan)
            return
        self._clear_stale()
        tmp.mkdir(parents=True)
        write_json_atomic(tmp / TRAIN_STATE, state, durable=True)
        write_json_atomic(tmp / PLAN, plan, durable=True)

    def _failed(self, exc: BaseException, *, tmp: Where, step: int) -> BaseException:
        """A save the file system refused (full, read-only, no permission, a file-size
        limit): its temporary folder goes, the newest complete checkpoint stays what
        ``latest`` means, and resuming is suggested only when there is one. A save that a
        second Ctrl-C (or SIGTERM) cut short is that interruption again, not a storage fault."""
        stop = interruption(exc)
        if stop is not None:
            if self.rank == 0 and not self.remote:
                shutil.rmtree(tmp, ignore_errors=True)
            return stop
        if self.remote:
            return self._failed_remote(exc, tmp=tmp, step=step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        why, fix = save_failure(exc, root=self.root)
        kept = complete(self.root)
        run_dir = self.root.parent if self.root.name == "checkpoints" else self.root
        if kept:
            then = (
                f"the newest complete checkpoint, {kept[0]}, is kept. Fix: {fix}, then resume: `llmforge resume "
                f"{pasteable('ckpt', run_dir, override=False)}`"
            )
        else:
            then = (
                f"no earlier checkpoint was saved, so there is nothing to resume. Fix: {fix}, then start again: `llmforge pretrain ... "
                f"{pasteable('run.dir', run_dir)} --overwrite`"
            )
        return fail(f"cannot save the checkpoint of step {step} into {tmp}: {why}; {then}", title="checkpoint not saved")

    def _failed_remote(self, exc: BaseException, *, tmp: str, step: int) -> UserError:
        """A save object storage refused: its objects go (no manifest was written), and the
        newest complete checkpoint stays what ``latest`` means."""
        with contextlib.suppress(Exception):
            if self.rank == 0:
                objstore.remove(tmp)
        error = storage_error(_os_error(exc), url=str(self.root), doing=f"save the checkpoint of step {step} into {tmp}")
        with contextlib.suppress(Exception):
            kept = complete(self.root)
            note = f"the newest complete checkpoint, {kept[0]}, is kept" if kept else "no earlier checkpoint was saved"
            error.problems[0] = Problem(
                error.problems[0].key, error.problems[0].value, f"{error.problems[0].rule}; {note}", error.problems[0].fix
            )
        return UserError(error.problems, title="checkpoint not saved")

    def _writer(self, tmp: Where) -> FileSystemWriter:
        if self.remote:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(tmp, sync_files=False)  # an object is stored once its upload completes; no fsync
        return FileSystemWriter(tmp)

    def _write(self, state: dict[str, Any], *, tmp: Where, final: Where, step: int) -> None:
        if self.async_save:
            future = dcp.async_save(state, storage_writer=self._writer(tmp), process_group=self._group, no_dist=not dist.is_initialized())
            self._pending = self._pool.submit(self._finish_async, future, tmp, final, step)  # type: ignore[union-attr]
            self._pending_tmp, self._pending_step = tmp, step
        else:
            dcp.save(state, storage_writer=self._writer(tmp), no_dist=not dist.is_initialized())
            if self.rank == 0:
                self._finalize(tmp, final, step)
            _barrier()

    def _finish_async(self, future: Future, tmp: Where, final: Where, step: int) -> None:
        future.result()
        if self.rank == 0:
            self._finalize(tmp, final, step)

    def _finalize(self, tmp: Where, final: Where, step: int) -> None:
        if self.remote:
            objstore.write_manifest(tmp, step=step)
        else:
            self._publish(tmp, final, step)
        for removed in rotate(self.root, keep=self.keep, protect=self._protect):
            self.log(f"removed old checkpoint {_name(removed)} (checkpoint.keep={self.keep})")

    def _publish(self, tmp: Path, final: Path, step: int) -> None:
        """Manifest, then the rename that makes the folder a checkpoint."""
        write_manifest(tmp, step=step)
        if final.exists():
            old = final.with_name(f".del-{final.name}")
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(self.root)

    def _clear_stale(self) -> None:
        """Remove leftovers of interrupted saves and removals."""
        for junk in list(self.root.glob(".tmp-step_*")) + list(self.root.glob(".del-step_*")):
            shutil.rmtree(junk, ignore_errors=True)

    def wait(self) -> None:
        """Block until a background save is written (a no-op when none is pending)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except UserError:
                raise
            except self._failures as exc:
                raise self._failed(exc, tmp=self._pending_tmp, step=self._pending_step) from None
            _barrier()

    def close(self) -> None:
        """Finish any background save and release the worker thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def load(*, path: Where, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model and optimizer in place, resharding to this layout; return the train state.

    Checks presence and sizes of every file first (the checksums are checked
    before launch); a missing or mismatched tensor is a UserError."""
    if is_url(path):
        objstore.verify(path, checksums=False)
    else:
        path = Path(path)
        verify(path, checksums=False)
    saved_keys = set(load_metadata(path).state_dict_metadata)
    refuse_unfused(path, saved_keys)
    state = tensor_state(model_parts, optimizer, for_load=True)
    primary, aliased = split_tied(state, saved_keys)
    try:
        with quiet_single_process():
            _dcp_load(primary, path)
            if TIED_HEAD not in saved_keys:  # the same on every rank: all take part in this load
                _dcp_load(aliased, path)
    except UserError:
        raise
    except Exception as exc:  # DCP wraps every failure (missing key, shape) in its own exception types
        raise fail(
            f"{path}: the saved model/optimizer do not fit this model ({_first_line(exc)})", title="cannot load checkpoint"
        ) from None
    apply_model_state(model_parts, state["model"])
    return train_state_of(path)


def train_state_of(path: Where) -> dict[str, Any]:
    """``train_state.json`` of a checkpoint on disk or in object storage."""
    return objstore.read_train_state(path) if is_url(path) else read_train_state(path)


def refuse_unfused(path: Where, saved_keys: set) -> None:
    """A checkpoint of a model saved before llmforge fused its projections (q/k/v and
    gate/up as separate tensors) cannot resume: its optimizer state is per part."""
    model = [k[len("model.") :] for k in saved_keys if k.startswith("model.")]
    stale = unfused_parts(model)
    if stale:
        example = sorted(stale)[0]
        raise UserError(
            [
                Problem(
                    "ckpt",
                    str(path),
                    f"saved before llmforge fused its projections ({', '.join(stale[example])} are now {example})",
                    f"export it with `llmforge export ckpt={path} --out DIR` and start a new run from it with model.init_from=DIR (the "
                    "optimizer state starts afresh)",
                )
            ],
            title="cannot load checkpoint",
        )


def _dcp_load(state: dict[str, Any], path: Where) -> None:
    dcp.load(
        state, storage_reader=safe_reader(path), planner=DefaultLoadPlanner(allow_partial_load=False), no_dist=not dist.is_initialized()
    )


def split_tied(state: dict[str, Any], saved_keys: set) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate the last pipeline stage's copy of a tied embedding (``head.weight``)
    when the checkpoint has none (it was saved without pipeline parallelism): the
    copy, and its optimizer state, load from ``embed.weight``'s."""
    primary: dict[str, Any] = {"model": dict(state["model"]), "optim": dict(state["optim"])}
    aliased: dict[str, Any] = {"model": {}, "optim": {}}
    if TIED_HEAD in saved_keys or "model.embed.weight" not in saved_keys:
        return primary, aliased
    if "head.weight" in primary["model"]:
        aliased["model"]["embed.weight"] = primary["model"].pop("head.weight")
    for key in [k for k in primary["optim"] if k.startswith("head.weight.")]:
        aliased["optim"]["embed.weight." + key[len("head.weight.") :]] = primary["optim"].pop(key)
    return primary, aliased


def _name(path: Where) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else path.name
