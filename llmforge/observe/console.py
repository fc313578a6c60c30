"""Rich progress bar with loss, throughput, MFU, peak memory and steps skipped as non-finite."""

from __future__ import annotations

from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainingProgress:
    def __init__(self, *, total_steps: int, start_step: int, enabled: bool, console: Optional[Console] = None, validation: bool = False) -> None:
        self.console = console or Console(stderr=True)
        self._progress: Optional[Progress] = None
        if not enabled:
            return
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            *([TextColumn("val [magenta]{task.fields[val]}")] if validation else []),
            TextColumn("[green]{task.fields[tps]}[/] tok/s"),
            TextColumn("MFU {task.fields[mfu]}"),
            TextColumn("mem {task.fields[mem]}"),
            TextColumn("{task.fields[skipped]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, loss="-", tps="-", val="-", mfu="-", mem="-", skipped="")
        self._progress.start()

    def update(self, *, step: int, loss: Optional[float] = None, tokens_per_s: Optional[float] = None, val_loss: Optional[float] = None,
               mfu: Optional[float] = None, memory_gib: Optional[float] = None, skipped: Optional[int] = None) -> None:
        if self._progress is None:
            return
        fields = {}
        if mfu is not None:
            fields["mfu"] = f"{mfu:.1%}"
        if memory_gib is not None:
            fields["mem"] = f"{memory_gib:.1f} GiB"
        if loss is not None:
            fields["loss"] = f"{loss:.4f}"
        if tokens_per_s is not None:
            fields["tps"] = f"{tokens_per_s:,.0f}"
        if val_loss is not None:
            fields["val"] = f"{val_loss:.4f}"
        if skipped:
            fields["skipped"] = f"[red]skipped {skipped}[/]"
        self._progress.update(self._task, completed=step, **fields)

    def print(self, message: str) -> None:
        self.console.print(message)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
