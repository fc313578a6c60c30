"""The estimate next to published runs, as tests/test_estimate_published.py and tests/test_search.py hold it.

    python tools/published_runs.py

Prints torchtitan's Llama 3.1 H100 rows: per row, llmforge's estimate (tokens/s per GPU), the
same with torchtitan's recompute policy, loss and async-TP pairs added, the published figure
(and the one held: the 405B rows, run with async TP, are estimated without it), their ratio;
then the memory of the most-loaded GPU with an fp32 residual stream
(``precision.fp32_residual=true``), with the default bf16 one, and the published figure
(docs/estimator.md has the estimate before the residual stream followed the compute dtype next
to them); then the responses (compile, Float8, schedule, 128 vs 8 GPUs), estimated against
published; then Megatron-LM's 462B row (README model table, H100 80 GB: TP 8, PP 16, DP 48),
which ran on 80 GB GPUs; last Megatron-style layouts of 18B-175B GPTs (TP 8 + SP, ZeRO 1, micro
batch 1, compiled), gradients reduced in fp32 and in bf16 (Megatron's default), without and
with ``parallel.async_tp``, term by term, and the async-TP gain the estimate gives torchtitan's
70B row next to the published one.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_estimate_published as published  # noqa: E402
import test_search as megatron  # noqa: E402

from llmforge.config.choices import Schedule  # noqa: E402
from llmforge.estimate.core import estimate  # noqa: E402
from llmforge.layout import Layout  # noqa: E402

GIB = 2**30


def _throughput() -> None:
    print(f"{'row':28s} {'estimate':>9s} {'+theirs':>8s} {'published':>9s} {'held':>6s} {'ratio':>6s}")
    for name, row in published.ROWS.items():
        est, tokens = published.per_gpu(row)
        held = published.held(row)
        print(
            f"{name:28s} {est.tokens_per_s / row.layout.world:9,.0f} {tokens:8,.0f} {row.tokens_per_s_per_gpu:9,.0f} "
            f"{held:6,.0f} {tokens / held:6.3f}"
        )


def _memory() -> None:
    print(f"\n{'row (GiB per GPU)':28s} {'fp32 res':>8s} {'bf16 res':>8s} {'published':>9s} {'ratio':>6s} {'held':>5s}")
    for name, row in published.ROWS.items():
        est, _ = published.per_gpu(row)
        before = estimate(row.shape, row.layout, dataclasses.replace(published.job(row), fp32_residual=True), every_stage=False)
        print(
            f"{name:28s} {before.worst.total / GIB:8.1f} {est.worst.total / GIB:8.1f} {row.memory_gib:9.1f} "
            f"{est.worst.total / GIB / row.memory_gib:6.3f} {'yes' if row.memory_held else 'no':>5s}"
        )


def _responses() -> None:
    pairs = [
        ("8B 8 GPUs compile", "8B 8 GPUs"),
        ("8B 8 GPUs compile float8", "8B 8 GPUs compile"),
        ("405B 512 GPUs interleaved", "405B 512 GPUs 1F1B"),
        ("8B 128 GPUs", "8B 8 GPUs"),
        ("8B 128 GPUs compile", "8B 8 GPUs compile"),
    ]
    print()
    for faster, slower in pairs:
        estimated, reported = published.ratio(faster, slower)
        print(f"{faster} / {slower}: estimate {estimated:.3f}, published {reported:.3f}")


def _megatron_462b() -> None:
    """GPT 462B (144 heads, 18432 wide, 112 layers, vocab 131072, seq 4096), batch 3072 on 6144 H100s,
    as llmforge runs Megatron's layout: distributed optimizer (ZeRO 1), sequence parallel, micro batch 1."""
    shape = dataclasses.replace(megatron.gpt(heads=144, hidden=18432, layers=112, vocab=131072, seq=4096), tie_embeddings=False)
    jb = megatron.job("h100-80gb", batch=3072, world=6144)
    print(f"\nMegatron-LM 462B, TP 8 x PP 16 x DP 48 on h100-80gb ({jb.profile.memory_bytes / GIB:.1f} GiB), ran there:")
    for recompute in ("none", "selective", "full"):
        layout = Layout(dp=48, tp=8, pp=16, zero=1, sequence_parallel=True, micro_batch_size=1, recompute=recompute)
        now = estimate(shape, layout, jb, every_stage=False)
        before = estimate(shape, layout, dataclasses.replace(jb, fp32_residual=True), every_stage=False)
        print(
            f"  recompute {recompute:9s} fp32 res {before.worst.total / GIB:5.1f}  bf16 res {now.worst.total / GIB:5.1f} GiB  "
            f"{'fits' if now.fits else 'does not fit'}"
        )


#: name, (heads, hidden, layers), tp, pp, GPUs, global batch: Narayanan et al.'s GPT shapes, seq 4096, vocab 131072
MEGATRON_STYLE = [
    ("18B", (48, 6144, 40), 8, 1, 256, 512),
    ("39B", (64, 8192, 48), 8, 1, 512, 512),
    ("39B", (64, 8192, 48), 8, 2, 512, 512),
    ("76B", (80, 10240, 60), 8, 4, 1024, 512),
    ("175B", (96, 12288, 96), 8, 8, 1024, 512),
]


#: Megatron-LM reduces gradients in the parameters' dtype unless told otherwise (its
#: ``DistributedDataParallelConfig.grad_reduce_in_fp32`` defaults to False; the command-line flag
#: ``--accumulate-allreduce-grads-in-fp32`` turns it on), so its layouts run with bf16 reduction.
MEGATRON_REDUCE_DTYPE = "bf16"


def megatron_virtual(layers: int, pp: int) -> int:
    """Megatron's interleaved schedule as its users set it: the fewest virtual stages above one
    that split each pipeline stage's layers evenly (1 without a pipeline)."""
    if pp == 1:
        return 1
    per_stage = layers // pp
    return next((v for v in range(2, per_stage + 1) if per_stage % v == 0), 1)


def megatron_style(name, dims, t, p, world, batch, *, async_tp: bool, reduce_dtype: str = MEGATRON_REDUCE_DTYPE, virtual: int = 1):
    """The estimate of one MEGATRON_STYLE row with the least recompute that fits; ``virtual``
    stages per pipeline rank run the interleaved 1F1B schedule."""
    heads, hidden, layers = dims
    shape = megatron.gpt(heads=heads, hidden=hidden, layers=layers, vocab=131072, seq=4096)
    jb = dataclasses.replace(megatron.job("h100-80gb", batch=batch, world=world), compile=True, reduce_dtype=reduce_dtype)
    for recompute in ("none", "selective", "full"):
        layout = Layout(
            dp=world // (t * p),
            tp=t,
            pp=p,
            zero=1,
            sequence_parallel=True,
            micro_batch_size=1,
            recompute=recompute,
            async_tp=async_tp,
            pp_schedule=Schedule.INTERLEAVED_1F1B if virtual > 1 else Schedule.ONE_F_ONE_B,
            pp_virtual_stages=virtual,
        )
        est = estimate(shape, layout, jb, every_stage=False)
        if est.fits:
            break
    return est


def _megatron_style() -> None:
    keys = (
        "matmul",
        "attention",
        "memory_bound",
        "launch_floor",
        "tp_exposed",
        "dp_all_gather_exposed",
        "dp_reduce_scatter_exposed",
        "pp_exposed",
        "bubble",
        "comm_overlap",
        "optimizer",
    )
    print(
        "\nMegatron-style layouts on h100-80gb (TP 8 + SP, ZeRO 1, micro batch 1, compiled), seconds per step,"
        " gradients reduced in fp32 and in bf16 (Megatron's default); v: virtual stages of the interleaved schedule:"
    )
    print(
        f"{'row':22s} {'red':>4s} {'async':>5s} "
        + " ".join(f"{k.replace('_exposed', ''):>9.9s}" for k in keys)
        + f" {'step':>6s} {'MFU':>6s}"
    )
    for name, dims, t, p, world, batch in MEGATRON_STYLE:
        virtual = megatron_virtual(dims[2], p)
        variants = [("fp32", False, 1), ("bf16", False, 1), ("bf16", True, 1)] + ([("bf16", True, virtual)] if virtual > 1 else [])
        for reduce_dtype, async_tp, v in variants:
            est = megatron_style(name, dims, t, p, world, batch, async_tp=async_tp, reduce_dtype=reduce_dtype, virtual=v)
            row = f"{name} tp{t} pp{p}{f'v{v}' if v > 1 else ''} dp{world // (t * p)} {est.layout.recompute[:3]}"
            print(
                f"{row:22s} {reduce_dtype:>4s} {'on' if async_tp else 'off':>5s} "
                + " ".join(f"{est.terms.get(k, 0.0):9.3f}" for k in keys)
                + f" {est.step_s:6.3f} {100 * est.mfu:5.1f}%"
            )


def _async_tp_pair() -> None:
    """torchtitan's 70B pair (829 -> 876 tokens/s per GPU with async TP) against the estimate's model of it."""
    row = published.ROWS["70B 256 GPUs"]
    _, off = published.per_gpu(row)
    _, on = published.per_gpu(row._replace(layout=dataclasses.replace(row.layout, async_tp=True)))
    print(
        f"\nasync TP on torchtitan's 70B row: estimate {off:,.0f} -> {on:,.0f} tokens/s per GPU ({on / off:.3f}x), "
        f"published 829 -> 876 ({876 / 829:.3f}x)"
    )


def main() -> None:
    _throughput()
    _memory()
    _responses()
    _megatron_462b()
    _megatron_style()
    _async_tp_pair()


if __name__ == "__main__":
    main()
