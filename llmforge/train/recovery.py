"""What a run does when the loop's guard raises (``llmforge.train.anomaly``): roll back to
the newest checkpoint older than the anomaly and go on, or stop with one message naming the
step, what was non-finite, and the command that resumes from the newest good checkpoint.

A rollback reloads that checkpoint's weights and optimizer state; the step count, the
learning-rate schedule and the data stream go on where they are, so the batches since
that checkpoint (those that diverged among them) are skipped: the run continues as if
their updates had never been applied (times ``train.rollback_lr_factor`` on the
learning rate). Checkpoints saved after the good one are kept aside as ``diverged-step_N``,
so neither ``latest`` nor a restart picks them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from llmforge.checkpoint import store
from llmforge.config.choices import AnomalyAction
from llmforge.errors import UserError, fail, pasteable
from llmforge.parallel.data import reshard_gathered
from llmforge.storage import is_url
from llmforge.train.anomaly import Anomaly, check_weights
from llmforge.train.components import Components
from llmforge.train.loop import LoopResult
from llmforge.train.optim import set_lr_scale


def train_recovering(
    c: Components,
    *,
    loop: Callable[[int], LoopResult],
    start_step: int,
    root: Path,
    saver,
    say: Callable[[str], None],
    run_dir: Path | None = None,
) -> LoopResult:
    """``loop(start_step)``; after a rollback, ``loop`` again from the step it was found at.
    A stop becomes the user error naming the newest good checkpoint under ``root`` (or how to
    start ``run_dir`` again)."""
    start = start_step
    while True:
        try:
            return loop(start)
        except Anomaly as anomaly:
            if anomaly.action != AnomalyAction.ROLLBACK:
                raise stop_error(anomaly, root=root, run_dir=run_dir) from None
            start = roll_back(c, anomaly=anomaly, root=root, saver=saver, say=say, run_dir=run_dir)


def check_and_save(c: Components, saver, *, step: int, train_state: dict[str, Any], plan: dict[str, Any]) -> None:
    """Save a checkpoint of finite weights only; rotation keeps the newest one before the first anomaly."""
    reshard_gathered(c.model_parts)  # check and save the sharded parameters, whatever ran last
    check_weights(c.guard, c.parameters(), step=step, distributed=c.rank.mesh is not None, device=c.rank.device)
    saver.save(step=step, model_parts=c.model_parts, optimizer=c.optimizer, train_state=train_state, plan=plan, protect=c.guard.protected())


def roll_back(c: Components, *, anomaly: Anomaly, root: Path, saver, say: Callable[[str], None], run_dir: Path | None = None) -> int:
    """Reload the newest checkpoint before ``anomaly.first_step``; return the step to go on from."""
    saver.wait()
    target = _agreed(store.newest_before(root, step=anomaly.first_step), distributed=c.rank.mesh is not None)
    if target is None:
        raise stop_error(anomaly, root=root, why="no checkpoint was saved before it to roll back to", run_dir=run_dir) from None
    good = store.step_of(target)
    store.load(path=target, model_parts=c.model_parts, optimizer=c.optimizer)
    c.guard.rolled_back(batches=anomaly.step - good)
    set_lr_scale(c.optimizer, c.scheduler, scale=c.guard.lr_scale)
    if c.rank.is_main:
        for path in store.step_dirs(root):
            if store.step_of(path) > good:
                store.set_aside(path, name=f"diverged-step_{store.step_of(path)}")
    if dist.is_initialized() and c.rank.mesh is not None:
        dist.barrier()
    p = c.guard.policy
    lr = f"; learning rate x{c.guard.lr_scale:g} from now on" if p.rollback_lr_factor != 1.0 else ""
    say(
        f"rollback {c.guard.rollbacks} of {p.max_rollbacks} at step {anomaly.step}: {anomaly}. "
        f"Reloaded {target} and skipped the {anomaly.step - good} batches of steps {good + 1}-{anomaly.step}{lr}"
    )
    return anomaly.step


def stop_error(anomaly: Anomaly, *, root: Path, why: str = "", run_dir: Path | None = None) -> UserError:
    """The message of a run stopped by its anomaly policy, with the way on from the newest good checkpoint.
    ``run_dir``: the run's folder (its checkpoints' parent unless they are in object storage)."""
    good = store.newest_before(root, step=anomaly.first_step)
    folder = run_dir if run_dir is not None else ("RUN_DIR" if is_url(root) else root.parent)
    if good is not None:
        way = (
            f"the newest checkpoint before step {anomaly.first_step} is {good}; continue from it (perhaps with a lower train.lr) with:\n  "
            f"llmforge resume {pasteable('ckpt', good, override=False)}"
        )
    else:
        way = (
            f"no checkpoint was saved before step {anomaly.first_step}: start again (perhaps with a lower train.lr) with `llmforge "
            f"pretrain ... {pasteable('run.dir', folder)} --overwrite`"
        )
    because = f", and {why}" if why else ""
    return fail(
        f"stopped at step {anomaly.step}: {anomaly}{because}. No update of a non-finite step was applied and no checkpoint holds one; "
        f"{way}",
        title="training stopped on non-finite numbers",
    )


def _agreed(path: Path | None, *, distributed: bool) -> Path | None:
    """Rank 0's choice on every rank."""
    if not (distributed and dist.is_initialized()):
        return path
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] else None
