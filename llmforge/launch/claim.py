"""A run takes its outputs before it starts: its run folder and, in object storage, its
``checkpoint.dir``. A new run (or a resume into another folder) never mixes its metrics
and checkpoints with an earlier run's: what another run left is refused, or with
``--overwrite`` deleted whole, in the folder and in the store alike; then the run records
itself as the owner of its ``checkpoint.dir`` (``llmforge.checkpoint.owner``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rich.console import Console

from llmforge.checkpoint import objstore, owner
from llmforge.errors import UserError, fail, pasteable
from llmforge.plan import RunPlan
from llmforge.storage import basename, is_url

#: What a run that has trained leaves in its folder. plan.json is not among them: on a
#: shared file system every node of a multi-node launch writes it before training starts.
RUN_FILES = ("metrics.jsonl", "checkpoints")


def holds(plan: RunPlan, checkpoint: Any) -> bool:
    """Whether the checkpoint is one of this run's (a resume that continues that run; a
    resume into another folder starts one there, and takes that folder like ``pretrain``)."""
    if is_url(checkpoint):
        return is_url(plan.checkpoint_root) and checkpoint.startswith(str(plan.checkpoint_root) + "/")
    return Path(plan.run_dir).resolve() in Path(checkpoint).resolve().parents


def claim_outputs(plan: RunPlan, *, resume_from: Any, overwrite: bool, console: Console) -> None:
    """Take ``plan``'s run folder and checkpoint.dir, or refuse (nothing changed) naming
    what another run left there and how to go on."""
    remote = str(plan.checkpoint_root) if is_url(plan.checkpoint_root) else None
    record = owner.read_owner(remote) if remote else None
    foreign = record is not None and not owner.is_owner(record, plan.run_dir)
    if resume_from is not None and holds(plan, resume_from):
        if foreign and remote:
            raise UserError([owner.foreign_problem(remote, record or {})], title="checkpoint.dir belongs to another run")
        if remote and record is None:
            owner.record_owner(remote, run_dir=plan.run_dir)
        return
    found = [plan.run_dir / name for name in RUN_FILES if (plan.run_dir / name).exists()]
    left = owner.left_by_runs(remote) if remote else []
    if not overwrite:
        if foreign and remote:
            raise UserError([owner.foreign_problem(remote, record or {})], title="checkpoint.dir belongs to another run")
        if found or left:
            raise fail(_held(plan.run_dir, found=found, remote=remote, left=left))
    elif found or left or foreign:
        _clear(plan.run_dir, found=found, remote=remote, console=console)
    if remote:
        owner.record_owner(remote, run_dir=plan.run_dir)


def _held(run_dir: Path, *, found: list[Path], remote: str | None, left: list[str]) -> str:
    """Why a new run cannot start over what an earlier run left, and how to go on."""
    complete = objstore.complete(remote) if remote else []
    local = any((run_dir / "checkpoints").glob("step_*/manifest.json"))
    names = ", ".join(p.name for p in found)
    if not found:
        steps = ", ".join(basename(u) for u in left)
        return (
            f"checkpoint.dir={remote} holds the checkpoints of an earlier run ({steps}); "
            + (f"continue it with `llmforge resume ckpt={remote}`, " if complete else "")
            + f"choose another checkpoint.dir (e.g. checkpoint.dir={owner.free_prefix(remote or '')}), "
            "or pass --overwrite to delete them and start over"
        )
    if remote and left:
        names += f"; its checkpoints are in {remote}"
    if local or complete:
        return (
            f"run.dir={run_dir} already holds a run ({names}); "
            f"continue it with `llmforge resume {pasteable('ckpt', run_dir, override=False)}`, "
            "choose another run.dir=..., or pass --overwrite to start over"
            + (f" (which deletes its checkpoints in {remote} too)" if remote and left else "")
        )
    return (
        f"run.dir={run_dir} holds an earlier run ({names}) that saved no complete checkpoint, so it cannot be resumed; "
        "pass --overwrite to start over there, or choose another run.dir=..."
    )


def _clear(run_dir: Path, *, found: list[Path], remote: str | None, console: Console) -> None:
    """--overwrite: delete the earlier run's files in the run folder and its checkpoints in the store."""
    for path in [*found, run_dir / "wandb_run_id", run_dir / "evals"]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    gone = owner.clear(remote) if remote else []
    where = f"{run_dir}" + (f" and its {len(gone)} checkpoint(s) in {remote}" if remote else "")
    console.print(f"--overwrite: removed the earlier run in {where}", style="yellow", markup=False, highlight=False)
