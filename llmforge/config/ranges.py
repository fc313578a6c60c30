"""Allowed ranges of the numeric config keys, declared on each schema field.

A field says ``knob(0.9, help=..., range="[0, 1)")``; ``range_problems`` checks every
numeric value of a config against its field's range in one pass (RunPlan.build() calls
it), and also refuses what no field can hold: a non-finite float (``nan``, ``1e309``)
or an integer past int64. Interval notation: ``[`` and ``]`` include the bound, ``(``
and ``)`` exclude it, ``inf`` is unbounded.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from llmforge.errors import Problem

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Range:
    """An interval of allowed values; ``str(Range)`` is its interval notation."""

    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> Range:
        """``"[0, 1)"``, ``"(0, inf)"``, ``"[1, inf)"``; ValueError when malformed."""
        text = text.strip()
        if len(text) < 5 or text[0] not in "[(" or text[-1] not in "])" or "," not in text:
            raise ValueError(f"not an interval: {text!r}")
        low, high = (float(part) for part in text[1:-1].split(","))
        if not low <= high:
            raise ValueError(f"empty interval: {text!r}")
        return cls(low=low, high=high, low_closed=text[0] == "[", high_closed=text[-1] == "]")

    def __contains__(self, value: float) -> bool:
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def __str__(self) -> str:
        return f"{'[' if self.low_closed else '('}{_num(self.low)}, {_num(self.high)}{']' if self.high_closed else ')'}"

    def describe(self, *, integer: bool) -> str:
        """The rule in words: 'must be a positive integer', 'must be 0 or more', 'must be in [0, 1)'."""
        if self.high == math.inf:
            if integer and self.low_closed and self.low == 1:
                return "must be a positive integer"
            if self.low == 0:
                return "must be 0 or more" if self.low_closed else "must be positive"
            if self.low_closed:
                return f"must be {_num(self.low)} or more"
        if integer and self.low_closed and self.high_closed and self.high - self.low <= 4:
            values = [str(v) for v in range(int(self.low), int(self.high) + 1)]
            return f"must be {', '.join(values[:-1])} or {values[-1]}"
        return f"must be in {self}"


def _num(value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return str(int(value)) if value == int(value) else repr(value)


def range_problems(config: Any, *, prefix: str = "") -> list[Problem]:
    """Every numeric value of a config dataclass outside its field's range, non-finite or past int64."""
    out: list[Problem] = []
    for f in dataclasses.fields(config):
        value, key = getattr(config, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.extend(range_problems(value, prefix=key + "."))
            continue
        problem = _value_problem(key, value, allowed=f.metadata.get("range"), default=f.default)
        if problem is not None:
            out.append(problem)
    return out


def _value_problem(key: str, value: Any, *, allowed: Range | None, default: Any) -> Problem | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    integer = isinstance(value, int)
    fix = _fix(key, allowed=allowed, default=default)
    if not integer and not math.isfinite(value):
        return Problem(key, value, "must be a finite number", fix)
    if integer and abs(value) > INT64_MAX:
        return Problem(key, value, "does not fit a 64-bit integer (at most 2**63-1)", fix)
    if allowed is not None and value not in allowed:
        return Problem(key, value, allowed.describe(integer=integer), fix)
    return None


def _fix(key: str, *, allowed: Range | None, default: Any) -> str:
    where = f"a value in {allowed}" if allowed is not None else "a finite value"
    example = f", e.g. {key}={default}" if isinstance(default, (int, float)) and not isinstance(default, bool) else " or null"
    return f"set {key} to {where}{example}"
