"""FP8 training with torchao's float8 linear layers (``precision.fp8``).

``apply_float8`` swaps the ``nn.Linear`` layers inside the transformer blocks
(attention projections, MLP, an MoE layer's shared experts) for torchao's
``Float8Linear``, as torchtitan's float8 converter does, and before any other
parallelism: tensor parallel, compile and FSDP then see the float8 modules. The
embedding, the output layer and the MoE router stay in ``precision.param_dtype``
(bf16 autocast), and so do the routed experts: they are batched matmuls over
stacked weights, not linear layers, and torchao's float8 grouped GEMM is a
CUDA-only prototype. A linear layer whose (local) weight has a dimension that is
not a multiple of 16 is left alone too (FP8 tensor cores need it).

Each float8 matmul casts its inputs to float8 with a dynamic scale (the absolute
maximum of the tensor, or of each row, computed every step): ``e4m3`` for
activations and weights, ``e5m2`` for gradients. The master weights stay fp32
and keep their names (checkpoints do not change).

Recipes (``precision.fp8_recipe``):

- ``tensorwise``: one scale per tensor. With FSDP (ZeRO 1-3) the weights can be
  all-gathered in float8 (``precision.fp8_all_gather``): each rank casts its shard
  with the scale of the whole tensor and half the bytes travel. The scales are
  then computed for all weights at once after the optimizer step
  (``precompute_float8_dynamic_scale_for_fsdp``), one all-reduce per step.
- ``rowwise``: one scale per row (more accurate, slower on H100 without fused
  kernels); FSDP gathers the fp32 weights.

Tensor parallel uses the plain styles for both recipes: its collectives move
high-precision activations (torchao's float8 styles gather float8 activations,
which gloo cannot carry, so they could not be tested on CPU). The scales are still
those of the whole tensor: a sharded weight or activation is a DTensor, and its
absolute maximum is reduced over the tensor-parallel ranks. Results match one
process up to float8 rounding: split matmuls sum in another order, and a last-bit
difference can round an element to the neighbouring float8 value.

``precision.fp8_emulate`` runs the same casts with the matmul emulated in high
precision: CPUs and GPUs without FP8 (tests, debugging), no speed-up.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from llmforge.config.choices import Fp8Recipe
from llmforge.errors import fail

#: Modules under a block that stay in high precision, by name.
SKIPPED = ("router",)


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """Import torchao without its warnings about CUDA kernels a CPU-only install lacks
    (and a torch deprecation notice it triggers): float8 training does not use them."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=False):
            lg.setLevel(level)


def float8_config(*, recipe: str, emulate: bool, fsdp_all_gather: bool):
    """torchao's Float8LinearConfig for a recipe name (``tensorwise`` or ``rowwise``)."""
    with quiet_torchao():
        from torchao.float8 import Float8LinearConfig

    if recipe == Fp8Recipe.TENSORWISE:
        return Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)
    base = Float8LinearConfig.from_recipe_name(str(recipe))  # torchao takes a plain str
    return Float8LinearConfig(**{**_fields(base), "emulate": emulate})


def _fields(config) -> dict:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def block_linear_filter(module: nn.Module, fqn: str) -> bool:
    """Convert a linear layer of a block unless it is the router or too narrow for FP8."""
    if not isinstance(module, nn.Linear) or any(part in SKIPPED for part in fqn.split(".")):
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def apply_float8(model: nn.Module, *, recipe: str, emulate: bool, fsdp_all_gather: bool) -> int:
    """Swap the linear layers of ``model``'s transformer blocks for Float8Linear in place
    (a whole model or a pipeline chunk); returns how many were converted."""
    device = next(model.parameters()).device
    if not emulate and device.type != "meta" and not has_fp8_hardware(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise fail(
            f"precision.fp8: this device ({name}) has no FP8 tensor cores (CUDA compute capability 8.9 or later); run on an "
            "H100/H200/B200, use precision=bf16, or precision.fp8_emulate=true (no speed-up)"
        )
    with quiet_torchao():
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

    config = float8_config(recipe=recipe, emulate=emulate, fsdp_all_gather=fsdp_all_gather)
    converted = 0
    for block in model.layers.values():
        convert_to_float8_training(block, module_filter_fn=block_linear_filter, config=config)
        converted += sum(isinstance(m, Float8Linear) for m in block.modules())
    return converted


def precompute_scales(parts: list[nn.Module]) -> Callable[[], None]:
    """What to run after every optimizer step with float8 all-gather under FSDP: the
    next forward's weight scales, for all float8 weights in one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def run() -> None:
        for part in parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return run


def has_fp8_hardware(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
