"""What rank 0 writes and shows of a run, as run parts: metrics.jsonl, W&B, TensorBoard and the
progress bar (``llmforge.observe`` holds the writers; these connect them to the loop)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from llmforge.checkpoint.store import SaveRecord
from llmforge.observe.console import TrainingProgress
from llmforge.observe.metrics import MetricsFile
from llmforge.observe.tensorboard import TensorBoardLog
from llmforge.observe.wandb_run import WandbRun
from llmforge.plan import RunPlan
from llmforge.train.callbacks import Callback
from llmforge.train.components import Components


class Metrics(Callback):
    """One metrics.jsonl line per logged step."""

    def __init__(self, plan: RunPlan) -> None:
        self.file = MetricsFile(plan.run_dir / "metrics.jsonl")

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(record)

    def close(self) -> None:
        self.file.close()


class Wandb(Callback):
    """The W&B run (``logging.wandb``); after a resume it continues the run whose id
    ``run.dir/wandb_run_id`` holds."""

    def __init__(self, plan: RunPlan, *, start_step: int) -> None:
        cfg = plan.config
        id_file = plan.run_dir / "wandb_run_id"
        resume_id = id_file.read_text().strip() if start_step > 0 and id_file.is_file() else None
        self.run = WandbRun(settings=cfg.logging.wandb, run_dir=plan.run_dir, name=cfg.run.name, config=plan.to_dict(), resume_id=resume_id)
        if self.run.run_id:
            id_file.write_text(self.run.run_id)

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(record, step=record["step"])

    def close(self) -> None:
        self.run.finish()


class Progress(Callback):
    """The Rich progress line: step, loss, validation loss, tokens/s, MFU, memory, checkpoints, skips."""

    def __init__(self, plan: RunPlan, c: Components, *, start_step: int, console: Console) -> None:
        self.bar = TrainingProgress(
            total_steps=plan.config.train.steps,
            start_step=start_step,
            enabled=plan.config.logging.console,
            console=console,
            validation=c.val_sampler is not None,
            mfu_approximate=c.meter is not None and getattr(c.meter, "peak_approximate", False),
        )

    def log(self, record: dict[str, Any]) -> None:
        self.bar.update(
            step=record["step"],
            loss=record["loss"],
            tokens_per_s=record["tokens_per_s"],
            val_loss=record.get("val_loss"),
            mfu=record.get("mfu"),
            memory_gib=record.get("peak_reserved_gib", record.get("peak_rss_gib")),
            skipped=record.get("skipped_steps"),
        )

    def step_end(self, step: int) -> None:
        self.bar.update(step=step)

    def checkpoint_saved(self, record: SaveRecord) -> None:
        self.bar.update(step=record.step, checkpoint=(record.step, record.stall_s))

    def close(self) -> None:
        self.bar.close()


class TensorBoard(Callback):
    """TensorBoard event files in run.dir (``logging.tensorboard``)."""

    def __init__(self, plan: RunPlan) -> None:
        self.log_file = TensorBoardLog(plan.run_dir)

    def log(self, record: dict[str, Any]) -> None:
        self.log_file.log(record)

    def close(self) -> None:
        self.log_file.close()


def observers(plan: RunPlan, c: Components, *, start_step: int, console: Console) -> list[Callback]:
    """Rank 0's writers (the progress bar first: it is closed first; it starts last, after W&B has said what it has to say)."""
    metrics, wandb = Metrics(plan), Wandb(plan, start_step=start_step)
    parts: list[Callback] = [Progress(plan, c, start_step=start_step, console=console), metrics, wandb]
    if plan.config.logging.tensorboard:
        parts.append(TensorBoard(plan))
    return parts
