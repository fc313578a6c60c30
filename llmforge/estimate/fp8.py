"""FP8 training (``precision.fp8``) in the estimate: which matmuls run on FP8 tensor
cores, the casts around them, and the memory they change. No torch.

As ``llmforge.parallel.float8`` converts them: the block linears ``llmforge.blockspec.fp8``
chooses by shape (with ``precision.fp8_linears=all`` every one whose dimensions are multiples
of 16: q, k, v, o, the MLP, an MoE layer's shared experts); never the embedding, the output
layer, the router or the routed experts.

- Compute: the kernel model prices each converted linear's float8 matmuls and casts
  (``llmforge.estimate.fp8_gain``); with a flat ``cluster.efficiency`` the converted matmuls
  (forward, the two backward matmuls, and their recompute) run at the profile's
  ``peak_tflops.fp8`` times it, everything else at the 16-bit peak.
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

from llmforge.config.choices import Recompute
from llmforge.estimate.inventory import BlockKind, Inventory, fp8_converts
from llmforge.estimate.params import StageCounts, Tensor, block_tensors
from llmforge.estimate.shape import Job, Shape

FP8 = 1
FP32 = 4
CAST_READS = 2  # a dynamic-scale cast reads its source for the absolute maximum, then for the cast

#: Whether a block's parameter is the weight of a linear layer FP8 runs (llmforge.estimate.inventory).
converted = fp8_converts


def converted_numel(shape: Shape, *, moe: bool, tp: int = 1) -> float:
    """Elements of one block's converted weights on a tensor-parallel rank (MoE layers are not split)."""
    total: float = sum(t.numel / (tp if t.split != "rep" else 1) for t in block_tensors(shape, moe) if converted(t, shape, moe=moe))
    return total


def _tail(shape: Shape, moe: bool) -> float:
    """Forward FLOPs per token of the block's last matmul, which full recompute skips (see flops)."""
    if not moe:
        return 2 * shape.hidden * shape.ffn
    return 2 * shape.hidden * shape.moe_ffn * shape.shared_experts


def block_flops(shape: Shape, *, moe: bool, mode: str, numel: float | None = None) -> float:
    """FP8 FLOPs per token of one block, forward + backward (+ recompute under ``mode``);
    ``numel``: its converted weights' elements where the caller has them."""
    forward = 2 * (converted_numel(shape, moe=moe) if numel is None else numel)  # every token passes each converted layer once
    extra = forward - _tail(shape, moe) if mode == Recompute.FULL else 0.0
    return 3 * forward + max(0.0, extra)


def stage_flops_per_token(inv: Inventory, counts: StageCounts) -> float:
    """FP8 FLOPs per token of one pipeline rank (before tensor/context splitting)."""
    shape, mode = inv.shape, inv.layout.recompute

    def block(moe: bool, mode: str) -> float:
        return block_flops(shape, moe=moe, mode=mode, numel=_whole_numel(inv.block(moe)))

    total = counts.dense * block(False, "none") + counts.dense_ckpt * block(False, mode)
    if counts.moe + counts.moe_ckpt:
        total += counts.moe * block(True, "none") + counts.moe_ckpt * block(True, mode)
    return total


def _whole_numel(kind: BlockKind) -> float:
    return float(sum(t.numel for t in kind.converted))


def _activation_elements(kind: BlockKind, *, tp: int) -> tuple[float, float]:
    """Per token on one tensor-parallel rank: elements of the converted linears' inputs
    and of their output gradients (column-parallel: whole input, split output;
    row-parallel: split input, whole output; MoE layers are not split)."""
    inputs = grads = 0.0
    for t in kind.converted:
        out_f, in_f = t.shape
        inputs += in_f / (tp if t.split == "row" else 1)
        grads += out_f / (tp if t.split == "col" else 1)
    return inputs, grads


def stage_cast_seconds(inv: Inventory, job: Job, counts: StageCounts, tokens: float, *, shard: int = 1, fused: bool = False) -> float:
    """Seconds of float8 casts and amax reductions for one microbatch of ``tokens`` on a stage
    (``shard``: the ZeRO shard group when FSDP gathers float8 weights, else 1). ``fused``
    (``train.compile``): the absolute maximum is taken in the kernel that produces the tensor,
    and one kernel reads it once and writes both float8 casts (``c + 2`` bytes per element)."""
    c, layout = job.compute_bytes, inv.layout
    per_element = c + 2 * FP8 if fused else 2 * (CAST_READS * c + FP8)  # the two casts of each activation / gradient element
    weight_cast = (FP32 + 2 * FP8) / 2 if fused else CAST_READS * FP32 + FP8
    blocks = {False: (counts.dense, counts.dense_ckpt), True: (counts.moe, counts.moe_ckpt)}
    nbytes = 0.0
    for moe, (plain, ckpt) in blocks.items():
        if not plain + ckpt:
            continue
        kind = inv.block(moe)
        inputs, grads = _activation_elements(kind, tp=layout.tp)
        recast = ckpt if layout.recompute == Recompute.FULL else 0  # a recomputed forward casts its inputs again
        nbytes += tokens * ((plain + ckpt) * (inputs + grads) * per_element + recast * inputs * per_element / 2)
        nbytes += (plain + ckpt) * kind.converted_numel * weight_cast * (1 / shard + 1)
    return nbytes / job.profile.memory_bandwidth


def working_bytes(inv: Inventory, job: Job) -> float:
    """The largest float8 working set of one linear layer: weight and transpose, input and transpose."""
    layout = inv.layout
    tokens = layout.micro_batch_size * inv.shape.seq / layout.cp
    largest = 0.0
    for kind in (inv.dense, inv.moe):
        for t in kind.converted if kind is not None else ():
            split = layout.tp if t.split != "rep" else 1
            largest = max(largest, 2 * FP8 * (t.numel / split + tokens * t.shape[1] / (split if t.split == "row" else 1)))
    return largest


__all__ = ["FP8", "Tensor", "block_flops", "converted", "converted_numel", "stage_cast_seconds", "stage_flops_per_token", "working_bytes"]
