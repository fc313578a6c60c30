"""Downstream evaluations in the training loop (``eval.tasks`` every ``eval.interval`` steps).

The tasks are loaded once, when the run starts. At an evaluation the data-parallel ranks of
a ZeRO 0 run split the documents (lm-eval's own split and gather); under ZeRO 1-3, whose
forward gathers the weights, every rank runs every request, in lockstep, so that all run the
same forwards. Rank 0 keeps the results: the metrics join that
step's record (``eval/TASK/METRIC``, ``eval_s``, ``eval_tokens_per_s``, ``tokens_seen``) and lm-eval's results go
to ``run.dir/evals/step_N.json``. The training state is left as it was: every module's
train/eval mode, the random streams (``llmforge.evaluate.tasks.kept_random_state``), and the
data samplers, which an evaluation never reads. Layouts that split the model itself (tensor,
pipeline, context or expert parallelism) are refused when the plan is built
(``llmforge.config.eval_rules``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console

from llmforge.checkpoint.export import run_tokenizer_file
from llmforge.evaluate.lm import harness_model
from llmforge.evaluate.results import flat_metrics, write_results
from llmforge.evaluate.tasks import load_tasks, run_tasks
from llmforge.plan import RunPlan
from llmforge.train.components import Components


class DownstreamEval:
    """``evaluator(step) -> metrics``: the run's tasks on the current weights."""

    def __init__(self, plan: RunPlan, c: Components, *, console: Console) -> None:
        cfg = plan.config
        self.settings, self.run_dir, self.is_main = cfg.eval, plan.run_dir, c.rank.is_main
        self.tokens_per_step = plan.tokens_per_step
        self.console = console
        self.model = c.model_parts[0]
        self.loaded = load_tasks(cfg.eval)
        path, eos_id = run_tokenizer_file(cfg, console=None)
        from tokenizers import Tokenizer

        self.lm = harness_model(
            model=self.model,
            tokenizer=Tokenizer.from_file(str(path)),
            eos_id=eos_id,
            seq_len=cfg.model.seq_len,
            batch_size=cfg.eval.batch_size,
            max_gen_tokens=cfg.eval.max_gen_tokens,
            split_over_ranks=plan.layout.zero == 0,
        )

    def __call__(self, step: int) -> dict[str, Any]:
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        self.lm.tokens_seen = 0
        start = time.perf_counter()
        try:
            with torch.no_grad():
                results = run_tasks(self.lm, self.loaded, limit=self.settings.limit)
        finally:
            for module, training in modes:
                module.training = training
        seconds = time.perf_counter() - start
        if results is None:  # a rank that ran its share of the documents: rank 0 has the results
            return {"eval_s": seconds}
        metrics = {
            **flat_metrics(results),
            "eval_s": seconds,
            "eval_tokens_per_s": self.lm.tokens_seen / max(seconds, 1e-9),
            "tokens_seen": step * self.tokens_per_step,
        }
        if self.is_main:
            write_results(results, run_dir=self.run_dir, step=step)
            shown = ", ".join(f"{k[len('eval/') :]} {v:.4f}" for k, v in metrics.items() if k.startswith("eval/") and "_stderr" not in k)
            self.console.print(f"step {step} evaluation ({seconds:.1f} s): {shown}", markup=False, highlight=False)
        return metrics
