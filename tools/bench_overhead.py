"""llmforge training throughput vs a plain PyTorch loop on the same model and batches.

Both sides train the tiny recipe's model from the same initial weights on the same
batches (read from the prepared built-in corpus) for the same number of steps,
in this process, alternating rounds so machine noise hits both alike. The plain
loop is what a user writes with the library's defaults: ``torch.optim.AdamW`` and
``clip_grad_norm_`` as they come, cross-entropy on the logits, ``loss.item()`` every
step. llmforge runs its own loop as a run does (logging every ``train.log_interval``
steps). The ratio is llmforge tokens/s over plain-loop tokens/s (target >= 0.97),
from the medians and from the best rounds.

    python tools/bench_overhead.py [--steps 30] [--rounds 5] [--clock wall|cpu] [overrides...]

``--clock cpu`` times both sides by the CPU time of this process (all its threads)
instead of the wall clock: on a machine others share, waiting for a core is left out,
so the ratio stays readable (run it with ``OMP_NUM_THREADS=1`` so that idle threads'
spinning is left out too).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmforge.config.compose import compose
from llmforge.models.gpt import GPT
from llmforge.plan import RunPlan
from llmforge.train.build import build_components
from llmforge.train.components import RankInfo
from llmforge.train.loop import train_loop
from llmforge.train.run import make_sampler, prepare_data


def plain_loop(plan: RunPlan, batches: list[torch.Tensor], clock: Callable[[], float] = time.perf_counter) -> float:
    """The textbook loop: gradient accumulation over the same microbatches, clip, AdamW,
    LambdaLR, all with torch's defaults. Returns seconds."""
    cfg = plan.config
    model = GPT(cfg.model)
    model.init_weights(seed=cfg.train.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), weight_decay=cfg.optim.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    started = clock()
    for batch in batches:
        micro = batch.split(cfg.train.micro_batch_size)
        for mb in micro:
            logits = model(mb[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten())
            (loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss.item()
    return clock() - started


def llmforge_loop(plan: RunPlan, prepared, steps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    c = build_components(plan, rank=RankInfo(), sampler=make_sampler(plan, prepared))
    started = clock()
    cfg = plan.config
    train_loop(
        c,
        start_step=0,
        total_steps=steps,
        grad_clip=cfg.optim.grad_clip,
        log_interval=cfg.train.log_interval,
        checkpoint_interval=0,
    )
    return clock() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall clock, or this process's CPU time (shared machines)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    plan = RunPlan.build(compose(["logging=quiet", *args.overrides]))
    from rich.console import Console

    prepared = prepare_data(plan, console=Console(stderr=True))
    sampler = make_sampler(plan, prepared)
    batches = [sampler.next_batch(dp_rank=0, dp_size=1) for _ in range(args.steps)]
    torch.manual_seed(0)
    plain_loop(plan, batches[:3])  # warm up kernels and allocator
    ours, plain = [], []
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for _ in range(args.rounds):
        ours.append(llmforge_loop(plan, prepared, args.steps, clock))
        plain.append(plain_loop(plan, batches, clock))
    tokens = args.steps * plan.tokens_per_step
    print(
        f"model: {plan.config.model.num_layers} layers x {plan.config.model.hidden_size}, {plan.tokens_per_step} tokens/step, "
        f"{args.steps} steps x {args.rounds} rounds, {torch.get_num_threads()} threads, {args.clock} clock"
    )
    for name, pick in (("median", statistics.median), ("best", min)):
        print(
            f"{name:6}: plain PyTorch loop {tokens / pick(plain):10,.0f} tokens/s, llmforge {tokens / pick(ours):10,.0f} tokens/s, "
            f"ratio llmforge/plain {pick(plain) / pick(ours):.3f}  (target >= 0.97)"
        )
    paired = sorted(p / o for p, o in zip(plain, ours, strict=False))
    print(f"per-round ratios: {', '.join(f'{r:.3f}' for r in paired)}")


if __name__ == "__main__":
    main()
