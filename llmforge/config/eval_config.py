"""The ``eval`` section: downstream tasks through lm-evaluation-harness, from ``llmforge eval``
and in the training loop (``eval.interval``). No torch."""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.fields import knob


@dataclass
class EvalConfig:
    tasks: list[str] = knob(
        help="lm-evaluation-harness tasks (or groups) to run, e.g. [hellaswag,arc_easy]: names from lm-eval's registry or from the task "
        "YAML files under eval.include_path.",
        factory=list,
    )
    include_path: list[str] = knob(
        help="Folders or task YAML files with tasks of your own (lm-eval's task format; dataset_path: json with data_files reads "
        "local files). Tasks found there need no download.",
        factory=list,
    )
    limit: float | None = knob(
        None,
        range="(0, inf)",
        help="Documents per task: a whole number (e.g. 100), or a fraction of the task below 1 (e.g. 0.1); null = every document.",
    )
    num_fewshot: int | None = knob(None, range="[0, inf)", help="Examples shown before each question (null = each task's own default).")
    batch_size: int = knob(8, range="[1, inf)", help="Requests scored in one forward pass.")
    max_gen_tokens: int = knob(
        256, range="[1, inf)", help="generate_until tasks: most tokens generated per request when the task does not set max_gen_toks."
    )
    interval: int = knob(
        0,
        range="[0, inf)",
        help="During pretraining: run eval.tasks on the current weights every N steps, logged with that step's record (0 = never).",
    )
