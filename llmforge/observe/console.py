"""Rich progress bar with loss, throughput, MFU, peak memory, the newest checkpoint and steps skipped as non-finite."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

#: Columns of the progress line written to a file or pipe (no terminal to fit): the whole line, unbroken.
LOG_WIDTH = 200


class TrainingProgress:
    def __init__(
        self,
        *,
        total_steps: int,
        start_step: int,
        enabled: bool,
        console: Console | None = None,
        validation: bool = False,
        mfu_approximate: bool = False,
    ) -> None:
        """``mfu_approximate``: the peak MFU is measured against is a guess, so MFU shows as ``~40.1%``."""
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._mfu_prefix = "~" if mfu_approximate else ""
        if not enabled:
            return
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=16),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            *([TextColumn("val [magenta]{task.fields[val]}")] if validation else []),
            TextColumn("[green]{task.fields[tps]}[/] tok/s"),
            TextColumn("MFU {task.fields[mfu]}"),
            TextColumn("mem {task.fields[mem]}"),
            TextColumn("ckpt {task.fields[ckpt]}"),
            TextColumn("{task.fields[skipped]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console if self.console.is_terminal else Console(file=self.console.file, width=LOG_WIDTH),
            transient=False,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=start_step, loss="-", tps="-", val="-", mfu="-", mem="-", ckpt="-", skipped=""
        )
        self._progress.start()

    def update(
        self,
        *,
        step: int,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        val_loss: float | None = None,
        mfu: float | None = None,
        memory_gib: float | None = None,
        checkpoint: tuple[int, float] | None = None,
        skipped: int | None = None,
    ) -> None:
        """``checkpoint``: (step, seconds training stalled) of the newest save."""
        if self._progress is None:
            return
        fields = {}
        if mfu is not None:
            fields["mfu"] = f"{self._mfu_prefix}{mfu:.1%}"
        if checkpoint is not None:
            fields["ckpt"] = f"{checkpoint[0]} ({checkpoint[1]:.2f}s)"
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
