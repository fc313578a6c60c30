"""The folder ``llmforge export`` writes: replaced whole, never merged.

An export is written into a temporary folder beside its target and swapped in when
complete, so no file of a previous export (a ``quantized.safetensors`` the new one does not
write) survives next to the new weights. A folder holding anything an export does not
write is someone else's: it is refused before any work, not replaced.

This module imports no torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from llmforge.errors import Problem, UserError

#: Every file an export may write (the weights, the tokenizer's files, the quantized model).
EXPORT_FILES = frozenset(
    {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "quantized.safetensors",
        "quantization.json",
    }
)


def refuse_other_files(out_dir: Path, *, key: str) -> None:
    """Refuse an existing folder that holds more than a previous export."""
    if not out_dir.is_dir():
        return
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in EXPORT_FILES)
    if not others:
        return
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    raise UserError(
        [
            Problem(
                key,
                str(out_dir),
                f"holds files an export does not write ({shown}), and an export replaces its folder whole",
                f"export into a new or empty folder, e.g. {key} {_free_beside(out_dir)}",
            )
        ],
        title="cannot write the output",
    )


def _free_beside(out_dir: Path) -> Path:
    """``DIR-export`` (or -2, ...) beside ``out_dir``: a folder that does not exist yet."""
    base = out_dir.absolute()
    for n in range(1, 100):
        candidate = base.with_name(f"{base.name}-export" + (f"-{n}" if n > 1 else ""))
        if not candidate.exists():
            return candidate
    return base.with_name(f"{base.name}-export-new")


def temporary_beside(out_dir: Path) -> Path:
    """A fresh, empty folder beside ``out_dir`` to write the export into."""
    tmp = out_dir.with_name(f".{out_dir.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def swap_in(tmp: Path, out_dir: Path) -> None:
    """Make the complete folder ``tmp`` the folder ``out_dir``; a previous one goes whole."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.export-old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)
