"""Weights & Biases: offline unless the user has a key, never a prompt."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmforge.config.choices import WandbMode
from llmforge.config.schema import WandbConfig


def resolve_mode(mode: str) -> str:
    """``auto`` is online with credentials, offline without; ``online`` without
    credentials also degrades to ``offline`` instead of prompting."""
    has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
    if mode in (WandbMode.AUTO, WandbMode.ONLINE):
        return "online" if has_key else "offline"
    return str(mode)


def _netrc_has_wandb() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class WandbRun:
    """A thin wrapper so the trainer calls log()/finish() whatever the mode."""

    def __init__(self, *, settings: WandbConfig, run_dir: Path, name: str, config: dict[str, Any], resume_id: str | None) -> None:
        self._run = None
        mode = resolve_mode(settings.mode)
        if mode == WandbMode.DISABLED:
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=name,
            dir=str(run_dir),
            mode=mode,
            config=config,
            id=resume_id,
            resume="allow" if resume_id else None,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    @property
    def run_id(self) -> str | None:
        return self._run.id if self._run is not None else None

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        if self._run is not None:
            self._run.log(metrics, step=step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
