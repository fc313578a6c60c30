"""Host cost of selective recompute next to none and full, on a model whose compute is cheap.

    python tools/bench_recompute.py [--rounds 7] [--steps 5] [--layers 12] [--hidden 96] [--heads 12]

gpt-125m's depth and heads (12 layers, 12 heads; LayerNorm, GELU, learned positions, biases) at a
small width and sequence, so a step is almost all host time: the Python and dispatcher work per op
that an eager GPU step pays while the GPU waits. bf16 autocast over a bf16 residual stream, as a
16-bit run keeps it. Modes, each on its own copy of the same model:

- ``none``;
- ``selective``: what an eager dense block runs (its cheap steps rebuilt from recipes,
  ``llmforge.parallel.rebuild``);
- ``selective-op``: op-level selective checkpointing (what compiled, MoE and tensor-parallel blocks
  run), here eager: a Python dispatch mode over every aten op of each block and its recompute;
- ``full``.

Prints per mode the median wall and process CPU time of a forward + backward over interleaved
rounds, the median of the per-round ratios to ``none`` (on a shared machine only paired ratios tell
anything), then counts that do not depend on the load: aten ops of forward and backward, the ops
the op-level policy sees, and the steps rebuilt in backward.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import llmforge.parallel.rebuild as rebuild
import llmforge.parallel.recompute as recompute
from llmforge.config.schema import ModelConfig
from llmforge.models.gpt import GPT
from llmforge.parallel.residual import apply_residual_dtype
from llmforge.train.loss import cross_entropy

MODES = {"none": ("none", False), "selective": ("selective", False), "selective-op": ("selective", True), "full": ("full", False)}


class AtenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def build(args: argparse.Namespace) -> tuple[dict, torch.Tensor]:
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        vocab_size=256,
        seq_len=args.seq,
        norm="layernorm",
        activation="gelu",
        position="learned",
        bias=True,
        tie_embeddings=True,
    )
    base = GPT(cfg)
    base.init_weights(seed=0)
    apply_residual_dtype(base, dtype=torch.bfloat16)
    models = {}
    for name, (mode, compiled) in MODES.items():
        models[name] = recompute.apply_recompute(copy.deepcopy(base), mode=mode, compiled=compiled)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    return models, tokens


def step(model: GPT, tokens: torch.Tensor, ops: AtenOps | None = None) -> tuple[float, int]:
    """Forward and backward; with ``ops``, the aten ops forward ran (the total is in ``ops.count``)."""
    with ops if ops is not None else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = cross_entropy(logits, tokens[:, 1:])
        forward = ops.count if ops is not None else 0
        loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), forward


def timings(models: dict, tokens: torch.Tensor, *, rounds: int, steps: int) -> dict:
    for model in models.values():
        for _ in range(2):
            step(model, tokens)
    out: dict = {name: {"wall": [], "cpu": []} for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(model, tokens)
            out[name]["wall"].append((time.perf_counter() - wall) / steps * 1e3)
            out[name]["cpu"].append((time.process_time() - cpu) / steps * 1e3)
    return out


def counts(models: dict, tokens: torch.Tensor) -> dict:
    """Per mode: (forward aten ops, backward aten ops, ops the op-level policy saw, steps rebuilt)."""
    seen: Counter = Counter()
    policy, value = recompute.selective_policy, rebuild._Recipe.value

    def counted_policy(*a, **k):
        seen["policy"] += 1
        return policy(*a, **k)

    def counted_value(self):
        seen["rebuilt"] += self.value_ is None
        return value(self)

    recompute.selective_policy, rebuild._Recipe.value = counted_policy, counted_value
    try:
        out = {}
        for name, model in models.items():
            seen.clear()
            ops = AtenOps()
            _, forward = step(model, tokens, ops)
            out[name] = (forward, ops.count - forward, seen["policy"], seen["rebuilt"])
    finally:
        recompute.selective_policy, rebuild._Recipe.value = policy, value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models, tokens = build(args)
    losses = {name: step(model, tokens)[0] for name, model in models.items()}
    assert len(set(losses.values())) == 1, losses
    times = timings(models, tokens, rounds=args.rounds, steps=args.steps)
    print(
        f"{args.layers} layers x {args.hidden} wide, {args.heads} heads, seq {args.seq}, batch {args.batch}; "
        f"{args.rounds} interleaved rounds of {args.steps} steps (ms per forward + backward)"
    )
    print(f"{'mode':14s} {'wall':>8s} {'cpu':>8s} {'wall/none':>10s} {'cpu/none':>9s}")
    for name, t in times.items():
        ratio = {k: statistics.median(a / b for a, b in zip(t[k], times["none"][k], strict=True)) for k in ("wall", "cpu")}
        print(
            f"{name:14s} {statistics.median(t['wall']):8.2f} {statistics.median(t['cpu']):8.2f} {ratio['wall']:10.3f} {ratio['cpu']:9.3f}"
        )
    print(f"\n{'mode':14s} {'fwd ops':>8s} {'bwd ops':>8s} {'policy calls':>12s} {'rebuilt':>8s}  (one step, aten ops)")
    for name, (fwd, bwd, policy, rebuilt) in counts(models, tokens).items():
        print(f"{name:14s} {fwd:8d} {bwd:8d} {policy:12d} {rebuilt:8d}")


if __name__ == "__main__":
    main()
