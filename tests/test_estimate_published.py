"""The step-time model against published runs of a PyTorch-native trainer (no torch).

torchtitan's Llama 3.1 benchmark on H100s (``benchmarks/llama3_h100_202412_torchtitan.md`` in
pytorch/torchtitan, end of 2024): FSDP2, tensor and pipeline parallel, torch.compile and
Float8, the backend llmforge builds on. TPS/GPU at iteration 90, memory the maximum over GPUs.
Their train configs use seq_len 8192. Every row runs on ONE profile, ``h100-96gb-hbm2e``,
made from their machine's documented figures: what is held is the model's response to
compile, Float8, 8 vs 128 GPUs, tensor parallel and the pipeline schedule, not a rate per row.

Where their run uses a technique llmforge lacks, the estimate is of llmforge without it and
the expected gap is named, computed by the model where it can be:

- torchtitan's selective recompute (``op`` policy: save the outputs of ``aten.mm`` but every
  second one, of attention and of ``max``) also recomputes every second matmul of a block's
  forward (k, o and the MLP's up projection, of q, k, v, o, gate, up, down), and under Float8
  every matmul (``_scaled_mm`` is not on its save list), which llmforge's selective keeps:
  the published run pays those matmuls again (``recomputed_matmul_seconds``); in eager mode it
  also reruns every memory-bound op of the forward and the weights' casts, where llmforge's eager
  dense blocks rebuild only their cheap steps (``op_level_recompute_seconds``);
- their loss is ``cross_entropy(logits.float())``: an fp32 copy of the logits that llmforge's
  chunked loss does not make (``fp32_logits_seconds``, as tests/test_estimate_speed.py
  swaps it for the plain loop);
- async tensor parallel in the 70B and 405B rows: the 70B async-TP row is estimated with
  ``parallel.async_tp`` and the pairs torch's pass fuses in their graph in place of llmforge's
  (``their_async_tp_seconds``), and its gain over the 70B row is held against the published
  one (876 / 829 = +5.7%); the 405B rows are estimated without it and held against the
  published figure / that gain.

Memory is held on the 70B rows (full recompute, no pipeline: both trainers keep the same set,
the bf16 block inputs) within 10%, each against its own published figure (async TP's 67.6 GiB,
its symmetric-memory buffers aside, is what the 71.9 GiB plan measures without them); the
others are reported (docs/estimator.md, ``python tools/published_runs.py``): llmforge's
selective keeps every matmul output, where theirs recomputes every second one, and the
405B rows depend on their pipeline's microbatching (torchtitan splits the local batch into
as many microbatches as there are stages by default) and the schedule's buffers. The 8B rows on
128 GPUs run 2-3% slower than on 8 in the published
table; the model
hides FSDP's traffic behind the blocks there too (every NIC of a node carries the gathers) and
charges what the hiding costs: FSDP2's copy out of the gather buffer on the compute stream, the
SMs NCCL's kernels hold while they run (``comm_sm_share``), longer on 16 nodes, and a latency per
ring hop (``comm_latency_us``): 128 GPUs come out 0.3% slower than 8. Every row is within 15%,
the furthest the 8B on 128 GPUs compiled (1.12).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest

from llmforge.estimate import async_tp as atp
from llmforge.estimate import kernels as kn
from llmforge.estimate.core import Estimate, estimate
from llmforge.estimate.params import stage_counts
from llmforge.estimate.shape import Job, Shape
from llmforge.hardware import get_profile
from llmforge.layout import Layout, selective_rebuilds

PROFILE = "h100-96gb-hbm2e"
ASYNC_TP_GAIN = 876 / 829  # their 70B pair, with and without async TP


def llama(layers: int, hidden: int, heads: int, ffn: int) -> Shape:
    return Shape(
        num_layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=8,
        ffn=ffn,
        vocab=128256,
        seq=8192,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        tie_embeddings=False,
        bias=False,
    )


LLAMA_8B, LLAMA_70B, LLAMA_405B = llama(32, 4096, 32, 14336), llama(80, 8192, 64, 28672), llama(126, 16384, 128, 53248)
FSDP8 = Layout(dp=8, zero=3, recompute="selective", micro_batch_size=2)
FSDP128 = dataclasses.replace(FSDP8, dp=128)
TP8 = Layout(dp=32, tp=8, zero=3, sequence_parallel=True, recompute="full", micro_batch_size=16)
PP8 = Layout(dp=8, tp=8, pp=8, zero=3, sequence_parallel=True, recompute="full", micro_batch_size=4, pp_layers=(16,) * 7 + (14,))
PP8_INTERLEAVED = dataclasses.replace(PP8, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_layers=(8,) * 14 + (7, 7))
TP8_ASYNC = dataclasses.replace(TP8, async_tp=True)


class Row(NamedTuple):
    shape: Shape
    layout: Layout
    global_batch: int
    compile: bool
    fp8: bool
    tokens_per_s_per_gpu: float
    memory_gib: float
    async_tp: bool = False
    memory_held: bool = False  # see the module docstring


ROWS = {
    "8B 8 GPUs": Row(LLAMA_8B, FSDP8, 16, False, False, 5762, 82.4),
    "8B 8 GPUs compile": Row(LLAMA_8B, FSDP8, 16, True, False, 6667, 77.0),
    "8B 8 GPUs compile float8": Row(LLAMA_8B, FSDP8, 16, True, True, 8532, 76.8),
    "8B 128 GPUs": Row(LLAMA_8B, FSDP128, 256, False, False, 5605, 67.0),
    "8B 128 GPUs compile": Row(LLAMA_8B, FSDP128, 256, True, False, 6514, 62.0),
    "8B 128 GPUs compile float8": Row(LLAMA_8B, FSDP128, 256, True, True, 8380, 61.8),
    "70B 256 GPUs": Row(LLAMA_70B, TP8, 512, True, True, 829, 71.9, memory_held=True),
    "70B 256 GPUs async TP": Row(LLAMA_70B, TP8_ASYNC, 512, True, True, 876, 67.6, async_tp=True, memory_held=True),
    "405B 512 GPUs 1F1B": Row(LLAMA_405B, PP8, 256, True, True, 100, 82.5, async_tp=True),
    "405B 512 GPUs interleaved": Row(LLAMA_405B, PP8_INTERLEAVED, 256, True, True, 128, 72.7, async_tp=True),
}


def job(row: Row) -> Job:
    return Job(
        global_batch=row.global_batch,
        param_dtype="bf16",
        reduce_dtype="fp32",
        profile=get_profile(PROFILE),
        nodes=row.layout.world // 8,
        fp8=row.fp8,
        fp8_all_gather=row.fp8,
        compile=row.compile,
    )


def recomputed_matmul_seconds(est: Estimate) -> float:
    """Seconds torchtitan's ``op`` selective policy adds to llmforge's selective recompute: the
    forward's 2nd, 4th and 6th matmuls of every block run again, under Float8 all seven (at the
    FP8 peak)."""
    if est.layout.recompute != "selective":
        return 0.0
    lay, job_, shape = est.layout, est.job, est.shape
    sp = kn.speeds(job_)
    t, h, kv, f = lay.micro_batch_size * shape.seq, shape.hidden, shape.kv_dim / lay.tp, shape.ffn / lay.tp
    # torchtitan's matmuls, unfused, in the order they run: wq, wk, wv, wo, w1, w3, w2
    gemms = [(t, h, h / lay.tp), (t, h, kv), (t, h, kv), (t, h / lay.tp, h), (t, h, f), (t, h, f), (t, f, h)]
    recomputed = range(len(gemms)) if job_.fp8 else (1, 3, 5)
    seconds = sum(sp.gemm(*gemms[i]).seconds for i in recomputed)
    if job_.fp8:
        seconds *= job_.profile.peak("bf16") / job_.profile.peak("fp8")
    return est.microbatches * stage_counts(est.shape, lay)[0].blocks * seconds


def op_level_recompute_seconds(est: Estimate) -> float:
    """What torchtitan's eager selective recompute runs again beyond llmforge's: theirs is op-level
    (torch's selective checkpointing), rerunning every memory-bound op of a block's forward and the
    weights' casts, where llmforge's eager dense blocks rebuild only their norms, one residual add,
    RoPE, the GQA repeat, the heads' merge and the activation (``llmforge.layout.selective_rebuilds``)."""
    lay, job_, shape = est.layout, est.job, est.shape
    if lay.recompute != "selective" or not selective_rebuilds(tp=lay.tp, moe=False, compiled=job_.compile):
        return 0.0
    sp, c = kn.speeds(job_), job_.compute_bytes
    k = kn.block_kernels(shape, t=lay.micro_batch_size * shape.seq / lay.cp, tp=lay.tp, sp=1, ep=lay.ep, c=c, mixed=job_.mixed, moe=False)
    costs = [kn.block_cost(sp, k, mode="selective", mixed=job_.mixed, c=c, accumulate=0.0, rebuilds=r).seconds for r in (False, True)]
    return est.microbatches * stage_counts(shape, lay)[0].blocks * (costs[0] - costs[1])


def fp32_logits_seconds(est: Estimate) -> float:
    """What ``cross_entropy(logits.float())`` costs more than llmforge's chunked loss (the last stage)."""
    sp, lay = kn.speeds(est.job), est.layout
    tokens, vocab = lay.micro_batch_size * est.shape.seq, est.shape.vocab / lay.tp
    kinds = [kn.loss_cost(sp, tokens=tokens, vocab=vocab, c=2, kind=k).seconds for k in ("fp32_logits", "chunked")]
    return est.microbatches * (kinds[0] - kinds[1])


def their_async_tp_seconds(est: Estimate) -> float:
    """What torchtitan's async TP hides less (or more) than llmforge's, per step: their q, k, v and
    gate, up are separate linears, so a column-parallel input gradient is a sum of matmuls and its
    reduce-scatter is not fused (pytorch/pytorch#149946); Float8ColwiseParallel gathers the input
    already in float8, so the forward gather feeds ``_scaled_mm`` and fuses, where the output
    gradient is gathered in bf16 and cast before its matmul (no fusion under Float8)."""
    lay = est.layout
    if not lay.async_tp:
        return 0.0
    theirs = {"forward_gather", "forward_scatter"} | (set() if est.job.fp8 else {"backward_gather"})
    counts = stage_counts(est.shape, lay)[0]
    kwargs = {"attention_layers": counts.blocks, "mlp_layers": counts.dense + counts.dense_ckpt}
    ours = atp.async_tp(est.shape, lay, est.job, **kwargs)
    them = atp.async_tp(est.shape, lay, est.job, pairs=frozenset(theirs), **kwargs)
    return est.microbatches * (ours.hidden - them.hidden + them.cost.seconds - ours.cost.seconds)


def per_gpu(row: Row) -> tuple[Estimate, float]:
    """The estimate, and its tokens/s per GPU with torchtitan's recompute policy, loss and async TP."""
    est = estimate(row.shape, row.layout, job(row), every_stage=False)
    step = est.step_s + recomputed_matmul_seconds(est) + op_level_recompute_seconds(est) + fp32_logits_seconds(est)
    step += their_async_tp_seconds(est)
    return est, est.tokens_per_step / step / row.layout.world


def held(row: Row) -> float:
    """The published tokens/s per GPU the estimate is held to: a row run with async TP but
    estimated without it (the 405B rows) against the published figure / ASYNC_TP_GAIN."""
    return row.tokens_per_s_per_gpu / (ASYNC_TP_GAIN if row.async_tp and not row.layout.async_tp else 1.0)


@pytest.mark.parametrize("name", list(ROWS))
def test_published_tokens_per_gpu_within_15_percent(name):
    row = ROWS[name]
    _, tokens = per_gpu(row)
    assert tokens == pytest.approx(held(row), rel=0.15)


def test_async_tp_gain_on_the_70b_row_follows_the_published_one():
    """torchtitan's one published pair, the same 70B plan without and with async TP (829 -> 876
    tokens/s per GPU): the estimate's gain within 15%. It used to be 1.30x, every TP collective
    hidden as far as a whole matmul lasted; torch's pass fuses only the pairs it finds, the
    decomposed matmuls run slower and the reduce-scatter's sum is a kernel of its own."""
    gain = per_gpu(ROWS["70B 256 GPUs async TP"])[1] / per_gpu(ROWS["70B 256 GPUs"])[1]
    assert gain > 1 and gain == pytest.approx(ASYNC_TP_GAIN, rel=0.15)


@pytest.mark.parametrize("name", [name for name, row in ROWS.items() if row.memory_held])
def test_published_memory_of_full_recompute_without_pipeline_within_10_percent(name):
    """The most-loaded GPU against the published maximum over GPUs (bf16 residual stream)."""
    row = ROWS[name]
    est, _ = per_gpu(row)
    assert est.worst.total / 2**30 == pytest.approx(row.memory_gib, rel=0.10)


def test_an_fp32_residual_stream_misses_the_70b_memory():
    """What the bf16 residual stream changes: with it in fp32 (``precision.fp32_residual``) the
    saved block inputs double and the 70B plan needs far more than torchtitan measured."""
    row = ROWS["70B 256 GPUs"]
    est, _ = per_gpu(row)
    fp32 = estimate(row.shape, row.layout, dataclasses.replace(job(row), fp32_residual=True), every_stage=False)
    blocks = row.layout.micro_batch_size * row.shape.seq * row.shape.hidden / row.layout.tp * row.shape.num_layers
    assert 2 * blocks <= fp32.worst.activations - est.worst.activations <= 1.02 * 2 * blocks  # and the final norm's input
    assert fp32.worst.total / 2**30 > 1.2 * row.memory_gib


def ratio(a: str, b: str) -> tuple[float, float]:
    """(estimated, published) tokens/s of row ``a`` over row ``b``."""
    return per_gpu(ROWS[a])[1] / per_gpu(ROWS[b])[1], ROWS[a].tokens_per_s_per_gpu / ROWS[b].tokens_per_s_per_gpu


@pytest.mark.parametrize(
    "faster,slower",
    [
        ("8B 8 GPUs compile", "8B 8 GPUs"),
        ("8B 128 GPUs compile", "8B 128 GPUs"),
        ("405B 512 GPUs interleaved", "405B 512 GPUs 1F1B"),
    ],
)
def test_response_to_compile_and_schedule_follows_the_published_one(faster, slower):
    """What compile and the interleaved schedule each buy, within a third of the published gain."""
    estimated, published = ratio(faster, slower)
    assert estimated > 1 and estimated - 1 == pytest.approx(published - 1, rel=0.35)


@pytest.mark.parametrize("rows", ["8B 8 GPUs", "8B 128 GPUs"])
def test_float8_gain_on_the_8b_rows_is_under_the_published_one_within_half(rows):
    """torchtitan's Float8 rows gain 28% over compiled bf16. The estimate's float8 model is held
    to the plain loop's gains on one H100 (docs/fp8.md: none at width 768, +6% at 2048, +10% at
    4096) and to torchao's microbenchmarks, and gives +17% here: it promises less than was
    published, never more, and at least half of it."""
    estimated, published = ratio(f"{rows} compile float8", f"{rows} compile")
    assert 1 < estimated < published and estimated - 1 == pytest.approx(published - 1, rel=0.5)


def test_128_gpus_cost_the_8b_little_more_than_8():
    """Across 16 nodes FSDP's gathers and reduce-scatters still hide behind the blocks: the
    published 128-GPU rows are 2-3% below the 8-GPU ones; the estimate slower too, within 5%."""
    for suffix in ("", " compile", " compile float8"):
        estimated, published = ratio(f"8B 128 GPUs{suffix}", f"8B 8 GPUs{suffix}")
        assert estimated < 1 and estimated == pytest.approx(published, rel=0.05)
