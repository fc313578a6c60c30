"""FP8 training (``precision.fp8``) in the estimate: which matmuls run on FP8 tensor
cores, the casts around them, and the memory they change. No torch.

As ``llmforge.parallel.float8`` converts them: the linear layers of the transformer
blocks whose weight dimensions are multiples of 16 (q, k, v, o, the MLP, an MoE
layer's shared experts); never the embedding, the output layer, the router or the
routed experts.

- Compute: the converted matmuls (forward, the two backward matmuls, and their
  recompute) run at the profile's ``peak_tflops.fp8`` times ``cluster.efficiency``,
  everything else at the 16-bit peak.
- Casts, memory-bound at the profile's memory bandwidth, as torchao's Float8Linear
  runs them (it keeps the high-precision input and weight for backward and casts them
  again there). A cast with a dynamic scale reads its source twice (absolute maximum,
  then the cast) and writes float8 once. Per element of a converted linear's input:
  a cast in forward and a transposed one for the weight gradient, ``2 (2c + 1)``
  bytes; of its output gradient: a cast and a transposed cast, ``2 (2c + 1)``; of its
  fp32 weight, per microbatch: a cast in forward and a transposed one for the input
  gradient, ``2 (2 x 4 + 1)`` (with float8 all-gather the forward cast runs on this
  rank's shard only). Under ``train.compile`` the absolute maximum is taken in the
  kernel that produces the tensor and one kernel writes both float8 copies (``c + 2``
  bytes per element, ``4 + 2`` per weight element). Kernel launches are not counted,
  which is why the estimate overstates FP8's gain on narrow models (see docs/fp8.md).
- Memory: a converted linear keeps its fp32 master weight for backward where autocast
  keeps a 16-bit copy per microbatch; one layer's float8 weight, its transpose and
  float8 copies of its input exist while it runs; ZeRO with float8 all-gather holds
  1 byte per gathered converted element instead of the compute dtype's.
"""

from __future__ import annotations

from functools import lru_cache

from llmforge.config.choices import Recompute
from llmforge.estimate.params import StageCounts, Tensor, block_tensors
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout

FP8 = 1
FP32 = 4
CAST_READS = 2  # a dynamic-scale cast reads its source for the absolute maximum, then for the cast


def converted(t: Tensor) -> bool:
    """Whether parameter ``t`` of a block is the weight of a linear layer FP8 runs."""
    if t.expert or len(t.shape) != 2 or not t.name.endswith("_proj.weight"):
        return False
    return t.shape[0] % 16 == 0 and t.shape[1] % 16 == 0


@lru_cache(maxsize=256)
def _converted(shape: Shape, moe: bool) -> tuple:
    return tuple(t for t in block_tensors(shape, moe) if converted(t))


@lru_cache(maxsize=1024)
def converted_numel(shape: Shape, *, moe: bool, tp: int = 1) -> float:
    """Elements of one block's converted weights on a tensor-parallel rank (MoE layers are not split)."""
    return sum(t.numel / (tp if t.split != "rep" else 1) for t in _converted(shape, moe))


def _tail(shape: Shape, moe: bool) -> float:
    """Forward FLOPs per token of the block's last matmul, which full recompute skips (see flops)."""
    if not moe:
        return 2 * shape.hidden * shape.ffn
    return 2 * shape.hidden * shape.moe_ffn * shape.shared_experts


@lru_cache(maxsize=1024)
def block_flops(shape: Shape, *, moe: bool, mode: str) -> float:
    """FP8 FLOPs per token of one block, forward + backward (+ recompute under ``mode``)."""
    forward = 2 * converted_numel(shape, moe=moe)  # every token passes each converted layer once
    extra = forward - _tail(shape, moe) if mode == Recompute.FULL else 0.0
    return 3 * forward + max(0.0, extra)


def stage_flops_per_token(shape: Shape, layout: Layout, counts: StageCounts) -> float:
    """FP8 FLOPs per token of one pipeline rank (before tensor/context splitting)."""
    mode = layout.recompute
    return (
        counts.dense * block_flops(shape, moe=False, mode=Recompute.NONE)
        + counts.moe * block_flops(shape, moe=True, mode=Recompute.NONE)
        + counts.dense_ckpt * block_flops(shape, moe=False, mode=mode)
        + counts.moe_ckpt * block_flops(shape, moe=True, mode=mode)
    )


@lru_cache(maxsize=1024)
def _activation_elements(shape: Shape, *, moe: bool, tp: int) -> tuple[float, float]:
    """Per token on one tensor-parallel rank: elements of the converted linears' inputs
    and of their output gradients (column-parallel: whole input, split output;
    row-parallel: split input, whole output; MoE layers are not split)."""
    inputs = grads = 0.0
    for t in _converted(shape, moe):
        out_f, in_f = t.shape
        inputs += in_f / (tp if t.split == "row" else 1)
        grads += out_f / (tp if t.split == "col" else 1)
    return inputs, grads


def stage_cast_seconds(
    shape: Shape, layout: Layout, job: Job, counts: StageCounts, tokens: float, *, shard: int = 1, fused: bool = False
) -> float:
    """Seconds of float8 casts and amax reductions for one microbatch of ``tokens`` on a stage
    (``shard``: the ZeRO shard group when FSDP gathers float8 weights, else 1). ``fused``
    (``train.compile``): the absolute maximum is taken in the kernel that produces the tensor,
    and one kernel reads it once and writes both float8 casts (``c + 2`` bytes per element)."""
    c, tp = job.compute_bytes, layout.tp
    per_element = c + 2 * FP8 if fused else 2 * (CAST_READS * c + FP8)  # the two casts of each activation / gradient element
    weight_cast = (FP32 + 2 * FP8) / 2 if fused else CAST_READS * FP32 + FP8
    blocks = {False: (counts.dense, counts.dense_ckpt), True: (counts.moe, counts.moe_ckpt)}
    nbytes = 0.0
    for moe, (plain, ckpt) in blocks.items():
        if not plain + ckpt:
            continue
        inputs, grads = _activation_elements(shape, moe=moe, tp=tp)
        recast = ckpt if layout.recompute == Recompute.FULL else 0  # a recomputed forward casts its inputs again
        nbytes += tokens * ((plain + ckpt) * (inputs + grads) * per_element + recast * inputs * per_element / 2)
        local = converted_numel(shape, moe=moe, tp=tp)
        nbytes += (plain + ckpt) * local * weight_cast * (1 / shard + 1)
    return nbytes / job.profile.memory_bandwidth


def working_bytes(shape: Shape, layout: Layout, job: Job) -> float:
    """The largest float8 working set of one linear layer: weight and transpose, input and transpose."""
    return _working_bytes(shape, layout.tp, layout.micro_batch_size * shape.seq / layout.cp)


@lru_cache(maxsize=4096)
def _working_bytes(shape: Shape, tp: int, tokens: float) -> float:
    largest = 0.0
    for moe in {False, shape.num_experts > 0}:
        for t in _converted(shape, moe):
            split = tp if t.split != "rep" else 1
            largest = max(largest, 2 * FP8 * (t.numel / split + tokens * t.shape[1] / (split if t.split == "row" else 1)))
    return largest
