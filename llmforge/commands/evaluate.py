"""``llmforge eval``: a checkpoint's model through lm-evaluation-harness tasks.

The checkpoint (any layout, a step folder, a run folder, ``latest`` or a URL) is rebuilt
whole on the CPU or one GPU, as ``generate`` does; the tasks are loaded before it, so bad
settings end before any work; lm-eval's results go to ``RUN/evals/step_N.json``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console

from llmforge.errors import Problem, UserError

ALLOWED = ("eval.", "data.cache_dir=")


def eval_command(overrides: list[str], *, device: str, tokenizer: Path | None, out: Console, err: Console) -> dict[str, Any]:
    """``llmforge eval ckpt=PATH eval.tasks=[...] [eval.*=...]``; returns lm-eval's results."""
    from llmforge.checkpoint.locate import locate
    from llmforge.checkpoint.resume import saved_config, split_ckpt
    from llmforge.checkpoint.store import step_of
    from llmforge.config.ranges import range_problems
    from llmforge.rundir import check_writable

    ckpt, rest = split_ckpt(overrides)
    bad = [o for o in rest if not o.lstrip("+~").startswith(ALLOWED)]
    if bad:
        raise UserError(
            [Problem(o.split("=", 1)[0], o, "eval takes only ckpt=, eval.* and data.cache_dir overrides", "remove it") for o in bad],
            title="bad overrides",
        )
    found = locate(ckpt)
    for note in found.notes:
        err.print(note, style="yellow", markup=False, highlight=False)
    check_writable(Path(found.run_dir) / "evals", key="ckpt", given=Path(str(found.run_dir)))
    config = saved_config(found.path, rest)
    problems = range_problems(config.eval, prefix="eval.")
    if problems:
        raise UserError(problems, title="bad eval settings")
    from llmforge.evaluate.tasks import load_tasks

    loaded = load_tasks(config.eval)
    results, seconds, tokens = _evaluate(found.path, config=config, loaded=loaded, device=device, tokenizer=tokenizer, err=err)
    from llmforge.evaluate.results import table, write_results

    step = step_of(found.path)
    out.print(table(results, title=f"{found.path} (step {step})"))
    written = write_results(results, run_dir=found.run_dir, step=step)
    err.print(
        f"{tokens:,} tokens in {seconds:.2f} s: {tokens / max(seconds, 1e-9):,.1f} tokens/s; results in {written}",
        markup=False,
        highlight=False,
    )
    return results


def _evaluate(
    path: Any, *, config: Any, loaded: dict[str, Any], device: str, tokenizer: Path | None, err: Console
) -> tuple[dict[str, Any], float, int]:
    """(results, seconds, tokens run through the model)."""
    from llmforge.evaluate.lm import harness_model
    from llmforge.evaluate.tasks import run_tasks
    from llmforge.generate import load_model, pick_device, run_tokenizer

    where = pick_device(device)
    tok, eos_id = run_tokenizer(config, tokenizer=tokenizer, console=err)
    model = load_model(path, config=config, device=where).eval()
    e = config.eval
    lm = harness_model(
        model=model, tokenizer=tok, eos_id=eos_id, seq_len=config.model.seq_len, batch_size=e.batch_size, max_gen_tokens=e.max_gen_tokens
    )
    err.print(
        f"evaluating {path} on {where}: {', '.join(e.tasks)}" + (f" (limit {e.limit:g})" if e.limit is not None else ""),
        markup=False,
        highlight=False,
    )
    start = time.perf_counter()
    results = run_tasks(lm, loaded, limit=e.limit)
    return results, time.perf_counter() - start, lm.tokens_seen
