"""Finding, loading and running lm-evaluation-harness tasks for ``eval.*`` settings.

Tasks come from lm-eval's registry or from the task YAML files under ``eval.include_path``.
When every task named is found there, the registry is not indexed (seconds saved, nothing
looked up online). Tasks are loaded (their data read or downloaded) once, before any model
is built, so an unknown task, a missing data file or a hub dataset with no network ends in
one message naming ``eval.tasks`` or ``eval.include_path``.

``run_tasks`` is lm-eval's ``evaluate`` on loaded tasks. It leaves Python's, NumPy's and
torch's random streams as it found them (the training loop's data order and dropout go on
unchanged), and the few-shot examples are drawn with a fixed seed every time.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmforge.config.eval_config import EvalConfig
from llmforge.errors import Problem, UserError

#: Bootstrap resamples for the standard error of metrics that are not means (perplexities).
BOOTSTRAP_ITERS = 1000
FEWSHOT_SEED = 1234
EXAMPLE = "eval.tasks=[hellaswag,arc_easy]"


def check_installed() -> None:
    """Refuse eval.* work before anything starts when lm-eval is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(
            [Problem("eval.tasks", None, "lm-evaluation-harness (lm-eval) is not installed", "pip install 'llmforge[eval]'")],
            title="lm-eval is not installed",
        ) from None


def check_settings(settings: EvalConfig) -> None:
    """Something to run, every include path present, and lm-eval installed."""
    check_installed()
    problems = []
    if not settings.tasks:
        problems.append(Problem("eval.tasks", [], "names no task", f"name lm-eval tasks, e.g. {EXAMPLE}"))
    for entry in settings.include_path:
        if not Path(entry).expanduser().exists():
            problems.append(Problem("eval.include_path", entry, "no such file or folder", "name a folder or task YAML file that exists"))
    if problems:
        raise UserError(problems, title="bad eval settings")


def task_manager(settings: EvalConfig) -> Any:
    """lm-eval's TaskManager over eval.include_path, and over the registry unless every task is found there."""
    from lm_eval.tasks import TaskManager

    include = [str(Path(p).expanduser()) for p in settings.include_path] or None
    if include:
        local = TaskManager(include_path=include, include_defaults=False)
        if all(name in local.all_tasks for name in settings.tasks):
            return local
    manager = TaskManager(include_path=include)
    unknown = [name for name in settings.tasks if name not in manager.all_tasks and not manager.match_tasks([name])]
    if unknown:
        raise UserError([_unknown(name, manager.all_tasks, settings) for name in unknown], title="unknown task")
    return manager


def _unknown(name: str, known: list[str], settings: EvalConfig) -> Problem:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    where = "lm-eval's registry" + (f" or {', '.join(settings.include_path)}" if settings.include_path else "")
    return Problem(
        "eval.tasks",
        name,
        f"is no task of {where}",
        f"{hint}list the registry with `lm-eval ls tasks`, or add a task YAML folder with eval.include_path=[DIR]",
    )


def load_tasks(settings: EvalConfig) -> dict[str, Any]:
    """The tasks with their data (lm-eval's ``TaskManager.load``), few-shot counts set."""
    check_settings(settings)
    manager = task_manager(settings)
    try:
        with quiet_lm_eval():
            loaded = manager.load(list(settings.tasks))
    except Exception as exc:  # the datasets library's own errors: no network, a missing file, a bad YAML
        raise UserError([_load_problem(settings, exc)], title="cannot load the tasks") from None
    for task in loaded["tasks"].values():
        if settings.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=settings.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
    return loaded


def _load_problem(settings: EvalConfig, exc: Exception) -> Problem:
    text = f"{type(exc).__name__}: {exc}".strip()
    offline = any(word in text.lower() for word in ("connection", "offline", "resolve", "network", "internet", "max retries"))
    fix = (
        "with no network, download the dataset elsewhere and name a task YAML whose dataset_path/data_files point at the local copy "
        "with eval.include_path=[DIR] (docs/eval.md)"
        if offline
        else "check the task YAML's dataset_path and data_files (paths are relative to where llmforge runs), then run again"
    )
    return Problem("eval.tasks", list(settings.tasks), f"could not load the task data ({text[:300]})", fix)


def run_tasks(lm: Any, loaded: dict[str, Any], *, limit: float | None) -> dict[str, Any]:
    """lm-eval's results dictionary for the loaded tasks (``results``, ``n-samples``, ``configs``, ...)."""
    from lm_eval.evaluator import evaluate

    for task in loaded["tasks"].values():
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    count = None if limit is None else (int(limit) if limit >= 1 else float(limit))
    with kept_random_state(), quiet_lm_eval():
        results = evaluate(lm=lm, task_dict=loaded, limit=count, bootstrap_iters=BOOTSTRAP_ITERS, log_samples=False)
    return results


@contextlib.contextmanager
def kept_random_state() -> Iterator[None]:
    """Python's, NumPy's and torch's random streams (CPU and CUDA) as they were before."""
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval's and the datasets library's info lines and progress bars kept off the console."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval", "datasets")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import datasets

        bars = datasets.utils.logging.is_progress_bar_enabled()
        datasets.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - datasets is a dependency
        bars = False
    import lm_eval.api.task as task_module
    from tqdm import tqdm

    bar = task_module.tqdm
    task_module.tqdm = functools.partial(tqdm, disable=True)  # its request-building bar has no switch of its own
    try:
        yield
    finally:
        task_module.tqdm = bar
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()
