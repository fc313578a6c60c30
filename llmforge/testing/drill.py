"""Anomaly drills on the equivalence harness's tiny model and synthetic data: a run with a
fault injected (``LLMFORGE_FAULT``'s ``RANK:STEP:KIND``) under its ``train.anomaly`` policy,
or the reference that skips the same batches by hand.

Started as ``python -m llmforge.testing.drill SPEC.json OUT.pt`` (the harness's command line),
a layout given as a dict is a drill: ``{"overrides": [...], "fault": "1:4-5:nan-grad",
"checkpoints": DIR}`` runs the guarded loop (saving every ``checkpoint.interval`` steps into DIR
and rolling back from there); ``{"overrides": [...], "skip": [FIRST, LAST], "lr_factor": F}`` is
the reference: steps 1..FIRST-1, then batches FIRST..LAST consumed with no update (the
schedule moving on), the learning rate times F, then the remaining steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from llmforge.checkpoint.store import CheckpointSaver
from llmforge.errors import UserError
from llmforge.plan import RunPlan
from llmforge.testing.harness import SyntheticSampler, full_parameters, rank_info
from llmforge.train.build import build_components
from llmforge.train.callbacks import Recorder
from llmforge.train.components import Components
from llmforge.train.instrument import inject_fault
from llmforge.train.loop import train_loop
from llmforge.train.optim import set_lr_scale
from llmforge.train.recovery import train_recovering
from llmforge.train.state import Checkpointer, stateful_parts


def run_drill(plan: RunPlan, spec: dict[str, Any], *, device: torch.device) -> dict[str, Any]:
    """One drill or reference run; rank 0 returns the final parameters, every logged record,
    the error a stop ended in and the lines a rollback printed."""
    cfg = plan.config
    torch.manual_seed(cfg.train.seed)
    sampler = SyntheticSampler(
        vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len, global_batch_size=cfg.train.global_batch_size, seed=cfg.train.seed
    )
    c = build_components(plan, rank=rank_info(plan, device=device, mesh_of_one=spec.get("mesh_of_one", False)), sampler=sampler)
    recorder = Recorder()
    said: list[str] = []
    root = Path(spec.get("checkpoints") or "/nonexistent-llmforge-drill")
    c, fault = inject_fault(c, spec=spec.get("fault") or "")
    saver = _saver(plan, root=root, rank=c.rank.rank) if spec.get("checkpoints") else None
    save = Checkpointer(c, saver=saver, plan=plan.to_dict(), parts=stateful_parts(c)) if saver is not None else None

    def loop(start: int, total: int = cfg.train.steps):
        interval = plan.checkpoint_interval if saver is not None else 0
        return train_loop(
            c,
            start_step=start,
            total_steps=total,
            grad_clip=cfg.optim.grad_clip,
            log_interval=1,
            checkpoint_interval=interval,
            callbacks=[recorder, *fault],
            save=save,
        )

    error = ""
    try:
        if spec.get("skip"):
            first, last = spec["skip"]
            loop(0, first - 1)
            skip_batches(c, count=last - first + 1)
            set_lr_scale(c.optimizer, c.scheduler, scale=spec.get("lr_factor", 1.0))
            loop(last)
        else:
            train_recovering(c, loop=loop, start_step=0, root=root, saver=saver, say=said.append)
    except UserError as exc:
        error = exc.message()
    finally:
        if saver is not None:
            saver.close()
    return {"params": full_parameters(c), "records": recorder.records, "error": error, "said": said}


def skip_batches(c: Components, *, count: int) -> None:
    """Consume ``count`` global batches and move the schedule on, updating nothing."""
    for _ in range(count):
        c.sampler.next_batch(dp_rank=c.rank.dp_rank, dp_size=c.rank.dp_size)
        c.scheduler.step()


def _saver(plan: RunPlan, *, root: Path, rank: int) -> CheckpointSaver:
    """A checkpoint saver under ``root``, as a run has one."""
    return CheckpointSaver(root=root, keep=plan.config.checkpoint.keep, async_save=False, rank=rank, log=lambda text: None)


if __name__ == "__main__":
    from llmforge.testing.harness import main

    main(sys.argv[1:], drill=run_drill)
