"""How many estimates one ``llmforge pretrain`` computes (the default run, in this process).

    LLMFORGE_AUTO_CALIBRATE=0 python tools/count_pretrain_estimates.py [overrides ...]

Counts calls of ``llmforge.estimate.core.estimate`` and ``llmforge.estimate.shape.from_plan``
(the meter's inputs) during the command; default overrides: ``train.steps=3`` and a fresh
``run.dir`` under a temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter

from llmforge.estimate import core, shape

CALLS: Counter = Counter()


def _counted(module, name: str) -> None:
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        CALLS[name] += 1
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def main() -> None:
    _counted(core, "estimate")
    _counted(shape, "from_plan")
    from llmforge.cli import app

    with tempfile.TemporaryDirectory() as tmp:
        overrides = sys.argv[1:] or ["train.steps=3", f"run.dir={tmp}/run"]
        try:
            app(["pretrain", *overrides], standalone_mode=False)
        except SystemExit as exc:
            if exc.code:
                raise
    print(f"pretrain {' '.join(overrides)}: estimate() {CALLS['estimate']} time(s), from_plan() {CALLS['from_plan']} time(s)")


if __name__ == "__main__":
    main()
