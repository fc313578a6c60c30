"""Errors a user can cause, reported as one clear message and exit code 2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input: where, what, why, and how to fix it."""

    key: str
    value: Any
    rule: str
    fix: str

    def render(self) -> str:
        head = f"{self.key} = {self.value!r}" if self.value != "" else self.key
        return f"{head}: {self.rule}. Fix: {self.fix}"


class UserError(Exception):
    """A mistake in the user's input. Carries every problem found, not only the first."""

    exit_code = 2

    def __init__(self, problems: Iterable[Problem] | str, *, title: str = "invalid input") -> None:
        if isinstance(problems, str):
            problems = [Problem(key="", value="", rule=problems, fix="")]
        self.problems: List[Problem] = list(problems)
        self.title = title
        super().__init__(self.message())

    def message(self) -> str:
        lines = [f"{self.title} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        for p in self.problems:
            lines.append(f"  - {p.render()}" if p.key else f"  - {p.rule}")
        return "\n".join(lines)


def fail(message: str, *, title: str = "error") -> "UserError":
    """A single-message user error (a missing file, a corrupted checkpoint, ...)."""
    return UserError([Problem(key="", value="", rule=message, fix="")], title=title)


def nearest(word: str, choices: Iterable[str]) -> str:
    """A 'did you mean' suffix, or an empty string."""
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""
