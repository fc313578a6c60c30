"""Attention masks on this machine, measured side by side in one process.

1. Training tokens/s of the tiny recipe's model under ``causal`` (SDPA's causal
   kernel), ``document`` (SDPA with the block-causal boolean mask) and a sliding
   window, on the same packed batches of the prepared built-in corpus, alternating
   rounds so machine noise hits each alike (forward, backward, AdamW).
2. The estimator's attention FLOPs for those windows under ``document`` against
   torch's flop counter running each window's documents alone (SDPA's math path:
   the counter does not see the CPU's fused kernel).
3. ``llmforge generate`` tokens/s with and without the KV cache at several prompt
   lengths (greedy, the same ids either way).

    python tools/bench_attention.py [--steps 8] [--rounds 3] [--window 32] [--new-tokens 32]
                                    [--only train|flops|generate] [overrides...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from llmforge.config.compose import compose
from llmforge.config.schema import GenerateConfig
from llmforge.estimate.attention import document_fraction
from llmforge.estimate.flops import block_flops
from llmforge.estimate.shape import shape_from_config
from llmforge.generate import generate_ids
from llmforge.models.gpt import GPT
from llmforge.models.masks import model_documents
from llmforge.plan import RunPlan
from llmforge.train.loss import cross_entropy
from llmforge.train.run import make_sampler, prepare_data


def train_seconds(model_cfg, batches, *, eos_id: int, seed: int) -> float:
    model = GPT(model_cfg)
    model.init_weights(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    for batch in batches:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        documents = model_documents(model_cfg, inputs, eos_id=eos_id)
        loss = cross_entropy(model(inputs, documents=documents), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def mask_speeds(plan: RunPlan, batches, *, eos_id: int, rounds: int, window: int) -> None:
    base = plan.config.model
    variants = {
        "causal": base,
        "document": type(base)(**{**base.__dict__, "attention_mask": "document"}),
        f"window {window}": type(base)(**{**base.__dict__, "sliding_window": window}),
    }
    tokens = sum(b[:, :-1].numel() for b in batches)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, cfg in variants.items():
            times[name].append(train_seconds(cfg, batches, eos_id=eos_id, seed=plan.config.train.seed))
    causal = tokens / statistics.median(times["causal"])
    print(f"training, {len(batches)} steps of {tuple(batches[0].shape)} tokens, median of {rounds} rounds:")
    for name, t in times.items():
        rate = tokens / statistics.median(t)
        print(f"  {name:12s} {rate:10,.0f} tokens/s   {rate / causal:.2f}x causal")


def flops_against_counter(plan: RunPlan, batches, *, eos_id: int) -> None:
    cfg = type(plan.config.model)(**{**plan.config.model.__dict__, "attention_mask": "document"})
    seq = cfg.seq_len
    stream = torch.cat([b[:, :-1].reshape(-1) for b in batches])
    ends = (torch.nonzero(stream == eos_id).flatten() + 1).tolist() + [stream.numel()]
    windows = (stream.numel() - 1) // seq  # as the sampler and the estimator cut the stream
    cuts = sorted({e for e in ends if e < windows * seq} | set(range(0, windows * seq + 1, seq)))
    model = GPT(cfg).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        for a, b in zip(cuts, cuts[1:], strict=False):
            model(stream[a:b][None])
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "bmm" in str(op))
    fraction = document_fraction(np.asarray(ends), seq=seq)
    estimated = block_flops(shape_from_config(cfg, attention_fraction=fraction), moe=False).attention * windows * seq * cfg.num_layers
    print(
        f"attention forward FLOPs of {windows} windows under document masks ({len(cuts) - 1} pieces): "
        f"estimator {estimated:,.0f}, flop counter {counted:,.0f} (ratio {estimated / counted:.4f}); "
        f"share of causal {fraction:.3f}"
    )


def generate_speeds(plan: RunPlan, *, lengths, new_tokens: int, repeats: int) -> None:
    model = GPT(plan.config.model).eval()
    model.init_weights(seed=0)
    print(f"generate, greedy, {new_tokens} new tokens, median of {repeats} alternating runs:")
    print(f"  {'prompt':>6s} {'no cache tok/s':>15s} {'KV cache tok/s':>15s} {'speed-up':>9s}  same ids")
    for length in lengths:
        prompt = torch.randint(1, plan.config.model.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        seconds, ids = {False: [], True: []}, {}
        for _ in range(repeats):  # alternating, so load bursts hit both alike
            for cache in (False, True):
                settings = GenerateConfig(max_tokens=new_tokens, temperature=0.0, stop_at_eos=False, kv_cache=cache)
                start = time.perf_counter()
                ids[cache] = generate_ids(
                    model, prompt, settings=settings, seq_len=plan.config.model.seq_len, eos_id=None, device=torch.device("cpu")
                )
                seconds[cache].append(time.perf_counter() - start)
        rates = [new_tokens / statistics.median(seconds[cache]) for cache in (False, True)]
        ids = [ids[False], ids[True]]
        print(f"  {length:6d} {rates[0]:15,.1f} {rates[1]:15,.1f} {rates[1] / rates[0]:8.1f}x  {ids[0] == ids[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--only", choices=["all", "train", "flops", "generate"], default="all")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    plan = RunPlan.build(compose(["recipe=tiny", "logging.wandb.mode=disabled", *args.overrides]))
    prepared = prepare_data(plan, console=None)
    sampler = make_sampler(plan, prepared)
    batches = [sampler.next_batch(dp_rank=0, dp_size=1) for _ in range(args.steps)]
    torch.manual_seed(0)
    if args.only in ("all", "train"):
        mask_speeds(plan, batches, eos_id=prepared.eos_id, rounds=args.rounds, window=args.window)
    if args.only in ("all", "flops"):
        flops_against_counter(plan, batches, eos_id=prepared.eos_id)
    if args.only in ("all", "generate"):
        seq = plan.config.model.seq_len
        generate_speeds(plan, lengths=[8, seq // 4, seq // 2, seq - 1 - args.new_tokens], new_tokens=args.new_tokens, repeats=args.rounds)


if __name__ == "__main__":
    main()
