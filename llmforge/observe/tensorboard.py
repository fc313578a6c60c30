"""TensorBoard: every numeric metric of a logged step as a scalar, under run.dir/tensorboard."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmforge.errors import Problem, UserError


def missing_problem() -> Problem:
    return Problem(
        "logging.tensorboard",
        True,
        "the tensorboard package is not installed",
        "pip install 'llmforge[tensorboard]' (or pip install tensorboard), or set logging.tensorboard=false",
    )


def check_installed() -> None:
    """Refuse ``logging.tensorboard=true`` before anything starts when tensorboard is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UserError([missing_problem()], title="a logger is not installed") from None


class TensorBoardLog:
    """A SummaryWriter fed with metrics.jsonl records (same names, x axis = step)."""

    def __init__(self, run_dir: Path) -> None:
        check_installed()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()
