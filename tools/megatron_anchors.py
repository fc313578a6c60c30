"""Megatron's layouts against Korthikanti's activation formula and the rehearsal.

    python tools/megatron_anchors.py [--rehearse] [NAME ...]

GPTs as Korthikanti et al. 2022 (22B, 175B: vocab 51200, seq 2048) and Megatron-LM's README
(314B, 462B: vocab 131072, seq 4096) run them: TP 8 with sequence parallel, ZeRO 1 (the
distributed optimizer), selective recompute, 1F1B, bf16, on h100-80gb. Per plan: the
formula's 34sbh/t bytes a layer, llmforge's estimate a layer under ``selective`` and ``none``
(Megatron's selective with a fused attention kernel: docs/parallelism.md), the first stage's
activations in flight, and the whole estimate by item; with ``--rehearse`` the rehearsal of
the most-loaded rank by item next to it, and how long it took.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from llmforge.commands.plans import build_plan
from llmforge.commands.rehearsal import ITEMS, whole_compute_copy
from llmforge.estimate.activations import layer_bytes
from llmforge.estimate.core import estimate_plan
from llmforge.estimate.inventory import inventory
from llmforge.estimate.memory import stage_activations
from llmforge.estimate.params import stage_counts
from llmforge.estimate.shape import from_plan

GIB = 2**30
MIB = 2**20


def gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> list[str]:
    return [
        "recipe=gpt-7b",
        f"model.num_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.num_heads={heads}",
        f"model.num_kv_heads={heads}",
        f"model.ffn_hidden_size={4 * hidden}",
        f"model.vocab_size={vocab}",
        f"model.seq_len={seq}",
    ]


def megatron(*, pp: int, dp: int, micro: int, batch: int) -> list[str]:
    nodes = 8 * pp * dp // 8
    return [
        "parallel.tp=8",
        f"parallel.pp={pp}",
        f"parallel.dp={dp}",
        "parallel.zero=1",
        "parallel.sequence_parallel=true",
        "parallel.recompute=selective",
        "parallel.pp_schedule=1f1b",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={batch}",
        "cluster.accelerator=h100-80gb",
        f"cluster.nodes={nodes}",
        "cluster.devices_per_node=8",
    ]


PLANS = {
    "22B": gpt(48, 6144, 64, 51200, 2048) + megatron(pp=1, dp=1, micro=4, batch=4),
    "175B": gpt(96, 12288, 96, 51200, 2048) + megatron(pp=8, dp=1, micro=1, batch=64),
    "314B": gpt(96, 16384, 128, 131072, 4096) + ["model.tie_embeddings=false"] + megatron(pp=8, dp=48, micro=1, batch=1536),
    "462B": gpt(112, 18432, 144, 131072, 4096) + ["model.tie_embeddings=false"] + megatron(pp=16, dp=48, micro=1, batch=3072),
}


def report(name: str, *, rehearse: bool) -> None:
    plan = build_plan(PLANS[name])
    est = estimate_plan(plan)
    shape, layout, job = from_plan(plan)
    b, s, h, t = layout.micro_batch_size, shape.seq, shape.hidden, layout.tp
    formula = 34 * s * b * h / t
    per_layer = {mode: layer_bytes(shape, dataclasses.replace(layout, recompute=mode), job, 0) for mode in ("selective", "none")}
    inv = inventory(shape, layout)
    in_flight = stage_activations(inv, job, est.worst.stage, est.microbatches)
    layers = stage_counts(shape, layout)[est.worst.stage].blocks
    print(f"\n{name}: {layout}")
    print(f"  a layer: Korthikanti 34sbh/t {formula / MIB:.1f} MiB; estimate selective {per_layer['selective'] / MIB:.1f} MiB")
    print(f"    ({per_layer['selective'] / formula:.2f}), none {per_layer['none'] / MIB:.1f} MiB ({per_layer['none'] / formula:.2f})")
    print(f"  stage {est.worst.stage} activations in flight: estimate {in_flight / GIB:.2f} GiB ({layers} layers)")
    line = "  ".join(f"{k} {getattr(est.worst, k) / GIB:.2f}" for k in ITEMS)
    print(f"  estimate ({est.worst.peak}): {line}  total {est.worst.total / GIB:.2f} GiB, {'fits' if est.fits else 'does not fit'}")
    if rehearse:
        from llmforge.rehearse.run import rehearse as run_rehearsal

        start = time.perf_counter()
        r = run_rehearsal(plan, stage=est.worst.stage)
        items = r.as_estimate_items(whole_compute_copy=whole_compute_copy(est))
        ratios = {k: items[k] / getattr(est.worst, k) if getattr(est.worst, k) else 0.0 for k in ITEMS}
        line = "  ".join(f"{k} {items[k] / GIB:.2f} ({ratios[k]:.2f})" for k in ITEMS)
        print(f"  rehearsed: {line}")
        need = r.peak_bytes + est.worst.reserved
        seconds = time.perf_counter() - start
        print(f"    peak {r.peak_bytes / GIB:.2f} + reserved {est.worst.reserved / GIB:.2f} = {need / GIB:.2f} GiB, {seconds:.0f} s")
        print(f"    activations at their own peak: rehearsed {r.activations_peak_bytes / GIB:.2f} GiB")


def main(argv: list[str]) -> None:
    rehearse = "--rehearse" in argv
    names = [a for a in argv if not a.startswith("--")] or list(PLANS)
    for name in names:
        report(name, rehearse=rehearse)


if __name__ == "__main__":
    main(sys.argv[1:])
