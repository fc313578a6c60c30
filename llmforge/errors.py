"""Errors a user can cause, reported as one clear message and exit code 2."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input: where, what, why, and how to fix it."""

    key: str
    value: Any
    rule: str
    fix: str

    def render(self) -> str:
        if not self.key:
            return f"{self.rule}. Fix: {self.fix}" if self.fix else self.rule
        head = f"{self.key} = {self.value!r}" if self.value != "" else self.key
        return f"{head}: {self.rule}. Fix: {self.fix}" if self.fix else f"{head}: {self.rule}"


class Terminated(BaseException):
    """SIGTERM arrived where a command unwinds for it (a data preparation): cleanups run as on Ctrl-C,
    then the process ends by SIGTERM (``end_by_sigterm``)."""


def end_by_sigterm() -> None:
    """End this process as SIGTERM's default action does (exit status 143 in a shell), once its cleanups ran."""
    import os
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    raise SystemExit(128 + signal.SIGTERM)  # where another thread took the signal and the process has not ended yet


class UserError(Exception):
    """A mistake in the user's input. Carries every problem found, not only the first."""

    exit_code = 2

    def __init__(self, problems: Iterable[Problem] | str, *, title: str = "invalid input") -> None:
        if isinstance(problems, str):
            problems = [Problem(key="", value="", rule=problems, fix="")]
        self.problems: list[Problem] = list(problems)
        self.title = title
        super().__init__(self.message())

    def message(self) -> str:
        """Plain text (never Rich markup): the title and every problem."""
        if len(self.problems) == 1 and not self.problems[0].key:
            text = self.problems[0].render()
            return f"{self.title}: {text}" if self.title else text
        lines = [f"{self.title or 'error'} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        lines += [f"  - {p.render()}" for p in self.problems]
        return "\n".join(lines)


def fail(message: str, *, title: str = "") -> UserError:
    """A single-message user error (a missing file, a corrupted checkpoint, ...)."""
    return UserError([Problem(key="", value="", rule=message, fix="")], title=title)


def nearest(word: str, choices: Iterable[str]) -> str:
    """A 'did you mean' suffix, or an empty string."""
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def error_text(message: str, *, label: str = "error:"):
    """``label message`` for a Rich console: only the label is styled, the message is
    printed as written (brackets in paths, values and rank errors are kept)."""
    from rich.text import Text

    return Text.assemble((label, "bold red"), " ", message)


def override_arg(key: str, value: object) -> str:
    """``key=value`` as the override parser reads it back unchanged (quoted where it has spaces,
    non-ASCII letters, commas, brackets, quotes, ...)."""
    import re

    text = str(value)
    if not re.fullmatch(r"[\w./+-]*", text, flags=re.ASCII):
        text = "'" + text.replace("'", "\\'") + "'"
    return f"{key}={text}"


def pasteable(key: str, value: object, *, override: bool = True) -> str:
    """``key=value`` as a user pastes it into a shell: quoted for the override parser (``override``:
    a Hydra override such as ``run.dir=``; ``ckpt=`` is not one) and for the shell, where needed."""
    import re
    import shlex

    arg = override_arg(key, value) if override else f"{key}={value}"
    if re.fullmatch(r"[\w@%+=:,./-]*", arg, flags=re.ASCII) or re.search(r"[\"$`\\!]", arg):
        return shlex.quote(arg)
    return f'"{arg}"'  # the shell leaves it as written: easier to read than shlex's '"'"' quoting
