"""Cross-field rules of ``eval.*`` during pretraining (part of ``RunPlan.build()``). No torch.

An evaluation in the loop runs the whole model on each rank, so layouts that split the model
itself are refused here, before launch; ``llmforge eval`` on their checkpoints runs them whole.
"""

from __future__ import annotations

from llmforge.config.schema import RunConfig
from llmforge.errors import Problem

#: Degrees that split one copy of the model over ranks.
SPLITTING = ("tp", "pp", "cp", "ep")


def check_eval(config: RunConfig) -> list[Problem]:
    e, p = config.eval, config.parallel
    if not isinstance(e.interval, int) or e.interval <= 0:
        return []
    if not e.tasks:
        return [Problem("eval.interval", e.interval, "evaluations in the loop need tasks", "name them, e.g. eval.tasks=[hellaswag]")]
    split = [f"parallel.{name}={getattr(p, name)}" for name in SPLITTING if isinstance(getattr(p, name), int) and getattr(p, name) > 1]
    if split:
        return [
            Problem(
                "eval.interval",
                e.interval,
                f"evaluations in the loop run the whole model on every rank, and {', '.join(split)} splits it",
                "set eval.interval=0 and evaluate the checkpoints with `llmforge eval ckpt=RUN_DIR eval.tasks=[...]`",
            )
        ]
    return []
