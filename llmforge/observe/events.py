"""run.dir/events.log: the run's housekeeping, one timestamped line each (checkpoints
saved with the time training stalled for them, old checkpoints removed). The
console shows only the newest checkpoint, in the progress display."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO


class EventLog:
    """Appends a line per event and flushes it; the file is created by the first event."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None

    def write(self, text: str) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {text}\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
