"""llmforge against a plain PyTorch loop on one GPU, same shape, in one process.

    python tools/bench_gpu.py [--model gpt-125m] [--micro-batch 8] [--steps 30] [--warmup 10]
                              [--modes eager compiled] [--rounds 1] [--fp8] [overrides...]

The plain loop is what a user writes: ``tools/plain_gpt.py``'s nanoGPT-style model of the same
shape (fused q/k/v projection, SDPA, tanh-GELU, LayerNorm, learned positions, tied embeddings),
fp32 weights, bf16 autocast, ``torch.optim.AdamW(fused=True)``,
``clip_grad_norm_``, ``F.cross_entropy`` on the fp32 logits, ``loss.item()`` every
step. llmforge trains the same shape through its own loop (``train.compile`` for the
compiled mode; the plain loop then compiles each block too). Both read random
tokens; one step is one microbatch unless ``--global-batch`` says otherwise.

Printed per mode: tokens/s of each (over the timed steps after the warm-up, between
two synchronisations), the ratio llmforge / plain, MFU (model FLOPs as the
estimator counts them, against the ``cluster.accelerator`` profile's bf16 peak),
peak allocated and reserved memory, llmforge's estimate and the measured / estimate
ratios, and llmforge's host synchronisations per step. ``--fp8`` adds llmforge rows
in bf16 and in fp8 (torchao tensorwise and rowwise, compiled) on the same shape:
tokens/s, the fp8 / bf16 ratio and the loss after the same steps
(``tools/bench_fp8.py``). Needs CUDA; no W&B, no network.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from plain_gpt import GPT  # tools/ is on the path when a tool runs

GIB = 1024**3


@dataclass
class Result:
    tokens_per_s: float
    peak_allocated: float
    peak_reserved: float
    syncs: str = ""
    #: what dynamo did over the row: graphs compiled (more than the blocks' few: recompiles) and graph breaks
    compiles: str = ""


def _batches(plan, device: torch.device, n: int = 4) -> list[torch.Tensor]:
    cfg = plan.config
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.model.seq_len + 1), generator=gen) for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peaks(device: torch.device) -> tuple:
    """(peak allocated, peak reserved) bytes: the CUDA allocator's, or resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    from llmforge.train.meter import measured_peak_bytes, peak_memory

    rss = measured_peak_bytes(peak_memory(device))
    return rss, rss


def _timed(step: Callable[[int], None], *, warmup: int, steps: int, device: torch.device) -> float:
    for i in range(warmup):
        step(i)
    _sync(device)
    started = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    _sync(device)
    return time.perf_counter() - started


def plain_loop(plan, *, compiled: bool, warmup: int, steps: int, device: torch.device) -> Result:
    m, cfg = plan.config.model, plan.config
    model = GPT(layers=m.num_layers, width=m.hidden_size, heads=m.num_heads, ffn=m.ffn_hidden_size, vocab=m.vocab_size, seq=m.seq_len)
    model.to(device)
    if compiled:
        torch._dynamo.reset()  # static graphs, as in a process of its own (llmforge.parallel.compile)
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.optim.weight_decay, fused=device.type == "cuda")
    batches, mb = _batches(plan, device), cfg.train.micro_batch_size

    def step(i: int) -> None:
        batch = batches[i % len(batches)].to(device)
        micro = batch.split(mb)
        for x in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x[:, :-1], x[:, 1:].contiguous())  # the logits' cross-entropy runs in fp32 under autocast
            (loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    seconds = _timed(step, warmup=warmup, steps=steps, device=device)
    return Result(steps * plan.tokens_per_step / seconds, *_peaks(device))


def llmforge_loop(plan, *, warmup: int, steps: int, device: torch.device) -> Result:
    from llmforge.testing.harness import SyntheticSampler
    from llmforge.train.build import build_components
    from llmforge.train.callbacks import Callback
    from llmforge.train.components import RankInfo
    from llmforge.train.loop import train_loop
    from llmforge.train.syncs import StepSyncs

    cfg = plan.config
    sampler = SyntheticSampler(
        vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len, global_batch_size=cfg.train.global_batch_size, seed=0
    )
    c = build_components(plan, rank=RankInfo(device=device), sampler=sampler)
    compiled_before = _compiled()
    done = [0]

    def run(until: int, callbacks: tuple[Callback, ...] = ()) -> None:
        train_loop(
            c,
            start_step=done[0],
            total_steps=until,
            grad_clip=cfg.optim.grad_clip,
            log_interval=10**9,
            checkpoint_interval=0,
            callbacks=callbacks,
        )
        done[0] = until

    run(warmup)
    _sync(device)
    started = time.perf_counter()
    run(warmup + steps)
    _sync(device)
    seconds = time.perf_counter() - started
    result = Result(steps * plan.tokens_per_step / seconds, *_peaks(device))
    syncs = StepSyncs(host=c.host_tensors)
    with syncs:
        run(done[0] + 4, (syncs,))  # the last of these is logged
    result.syncs = "/".join(str(n) for n in syncs.per_step)
    graphs, breaks = (now - before for now, before in zip(_compiled(), compiled_before, strict=True))
    result.compiles = f"{graphs} graphs compiled, {breaks} graph breaks"
    return result


def _compiled() -> tuple[int, int]:
    """dynamo's running counts in this process: graphs compiled and graph breaks."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _fresh(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build_plan(args: argparse.Namespace, *, compiled: bool):
    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan

    overrides = [
        f"model={args.model}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.global_batch or args.micro_batch}",
        "precision=bf16",
        "parallel=single",
        f"cluster.accelerator={args.accelerator}",
        "cluster.devices_per_node=1",
        "logging.wandb.mode=disabled",
        "logging.console=false",
        f"train.compile={'true' if compiled else 'false'}",
        *args.overrides,
    ]
    return RunPlan.build(compose(overrides))


def report(plan, mode: str, plain: Result, ours: Result) -> None:
    from llmforge.estimate import flops
    from llmforge.estimate.core import estimate_plan
    from llmforge.estimate.shape import from_plan

    shape, _, job = from_plan(plan)
    per_token = flops.model_flops(shape, 1)
    peak = job.profile.peak(job.param_dtype)
    est = estimate_plan(plan)
    expected_mem = est.worst.total - job.profile.runtime_reserved_bytes
    print(
        f"\n{mode}: {shape.num_layers} layers x {shape.hidden}, micro batch {plan.config.train.micro_batch_size}, "
        f"{plan.tokens_per_step} tokens/step, {plan.config.parallel.recompute} recompute"
    )
    print(f"  {'':10} {'tokens/s':>10} {'MFU':>6} {'peak alloc':>11} {'peak reserved':>14}")
    for name, r in (("plain", plain), ("llmforge", ours)):
        print(
            f"  {name:10} {r.tokens_per_s:10,.0f} {r.tokens_per_s * per_token / peak:6.1%} {r.peak_allocated / GIB:9.2f} GiB "
            f"{r.peak_reserved / GIB:10.2f} GiB"
        )
    print(f"  ratio llmforge / plain: {ours.tokens_per_s / plain.tokens_per_s:.3f}")
    print(
        f"  llmforge estimate: {est.tokens_per_s:,.0f} tokens/s, {expected_mem / GIB:.2f} GiB (without the runtime reservation); "
        f"measured/estimate: tokens/s {ours.tokens_per_s / est.tokens_per_s:.2f}x, peak reserved {ours.peak_reserved / expected_mem:.2f}x"
    )
    print(f"  llmforge host syncs per step (3 steps after a first, the last logged): {ours.syncs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-125m", help="a model option (gpt-125m, gpt-350m, gpt-1b, ...)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=0, help="default: one microbatch per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--rounds", type=int, default=1, help="alternate plain and llmforge this many times; the best of each is kept")
    parser.add_argument("--accelerator", default="h100-80gb", help="hardware profile for MFU and the estimate")
    parser.add_argument("--fp8", action="store_true", help="also llmforge in bf16 vs fp8 (tensorwise, rowwise), compiled")
    parser.add_argument("overrides", nargs="*", help="llmforge overrides, e.g. parallel.recompute=selective")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/bench_gpu.py needs a CUDA GPU")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    for mode in args.modes:
        plan = build_plan(args, compiled=mode == "compiled")
        best_plain = best_ours = None
        for _ in range(args.rounds):
            _fresh(device)
            plain = plain_loop(plan, compiled=mode == "compiled", warmup=args.warmup, steps=args.steps, device=device)
            _fresh(device)
            ours = llmforge_loop(plan, warmup=args.warmup, steps=args.steps, device=device)
            best_plain = plain if best_plain is None or plain.tokens_per_s > best_plain.tokens_per_s else best_plain
            best_ours = ours if best_ours is None or ours.tokens_per_s > best_ours.tokens_per_s else best_ours
        report(plan, mode, best_plain, best_ours)
        _fresh(device)
    if args.fp8:
        fp8_report(args)


def fp8_report(args: argparse.Namespace) -> None:
    """llmforge bf16 against fp8 on this shape, compiled, measured one after the other here."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_fp8 import precision_rows

    shape = [
        f"model={args.model}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.global_batch or args.micro_batch}",
        "parallel=single",
        f"cluster.accelerator={args.accelerator}",
        "cluster.devices_per_node=1",
        "logging=quiet",
        "logging.wandb.mode=disabled",
        "checkpoint.save_final=false",
        *args.overrides,
    ]
    rows = precision_rows(shape, steps=args.steps + args.warmup, warmup=args.warmup)
    print(f"\nfp8 (compiled, {args.steps + args.warmup} steps, median tokens/s after {args.warmup}):")
    print(f"  {'':16} {'tokens/s':>10} {'vs bf16':>8} {'loss':>8} {'peak alloc':>11} {'estimate':>10}")
    for name, row in rows.items():
        print(
            f"  {name:16} {row['tokens_per_s']:10,.0f} {row.get('ratio', 1.0):8.3f} {row['loss']:8.4f} "
            f"{row['peak_gib']:8.2f} GiB {row['estimate_tokens_per_s']:10,.0f}"
        )


if __name__ == "__main__":
    main()
