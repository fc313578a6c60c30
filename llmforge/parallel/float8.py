"""FP8 training with torchao's float8 linear layers (``precision.fp8``).

``apply_float8`` swaps the ``nn.Linear`` layers of the transformer blocks that
``llmforge.blockspec.fp8`` chooses by shape (the plan lists the same ones) for torchao's
``Float8Linear``, as torchtitan's float8 converter does, and before any other
parallelism: tensor parallel, compile and FSDP then see the float8 modules. The
embedding, the output layer and the MoE router stay in ``precision.param_dtype``
(bf16 autocast), and so do the routed experts: they are batched matmuls over
stacked weights, not linear layers, and torchao's float8 grouped GEMM is a
CUDA-only prototype. So does every linear too small for float8 to pay, or whose
dimensions are not multiples of 16.

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
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from llmforge.blockspec.fp8 import KEPT_HIGH_PRECISION, Fp8Choice
from llmforge.config.choices import Fp8Recipe
from llmforge.errors import fail
from llmforge.models.layers import MLP

#: Modules under a block that stay in high precision, by name.
SKIPPED = KEPT_HIGH_PRECISION


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


def apply_float8(model: nn.Module, *, recipe: str, emulate: bool, fsdp_all_gather: bool, choice: Fp8Choice) -> int:
    """Swap the linear layers ``choice`` names in ``model``'s transformer blocks for Float8Linear in
    place (a whole model or a pipeline chunk); returns how many were converted."""
    device = next(model.parameters()).device
    if not emulate and device.type != "meta" and not has_fp8_hardware(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise fail(
            f"precision.fp8: this device ({name}) has no FP8 tensor cores (CUDA compute capability 8.9 or later); run on an "
            "H100/H200/B200, use precision=bf16, or precision.fp8_emulate=true (no speed-up)"
        )
    return convert_blocks(model, choice=choice, config=float8_config(recipe=recipe, emulate=emulate, fsdp_all_gather=fsdp_all_gather))


def convert_blocks(model: nn.Module, *, choice: Fp8Choice, config: object) -> int:
    """Convert exactly the linears ``choice`` names in each block with torchao's ``config``;
    a name the block lacks means the model and its description disagree."""
    with quiet_torchao():
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

    converted = 0
    for index, block in model.layers.items():
        names = choice.names(moe=not isinstance(getattr(block, "mlp", None), MLP))
        convert_to_float8_training(block, module_filter_fn=functools.partial(_named_linear, names=names), config=config)
        done = {fqn for fqn, m in block.named_modules() if isinstance(m, Float8Linear)}
        if done != names:
            raise RuntimeError(f"block {index}: float8 converted {sorted(done)}, the plan chose {sorted(names)}")
        converted += len(done)
    return converted


def _named_linear(module: nn.Module, fqn: str, *, names: frozenset[str]) -> bool:
    return isinstance(module, nn.Linear) and fqn in names


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
