"""``knob``: a config field with its help text and allowed range (every schema module uses it).

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from llmforge.config.ranges import Range


def knob(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None, range: str | None = None) -> Any:
    """A dataclass field with a help text and, for a number, its allowed range in interval
    notation (``"[0, 1)"``; checked by llmforge.config.ranges.range_problems)."""
    metadata: dict[str, Any] = {"help": help}
    if range is not None:
        metadata["range"] = Range.parse(range)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)
