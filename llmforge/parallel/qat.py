"""Quantization-aware training with torchao's QAT (``precision.qat``).

``apply_qat`` swaps the ``nn.Linear`` layers inside the transformer blocks (attention
projections, MLP, an MoE layer's shared experts) for torchao's ``FakeQuantizedLinear``
(``quantize_`` with ``QATConfig(base, step="prepare")``), before any other
parallelism, as float8 is applied. The embedding, the output layer, the MoE router and
the routed experts (batched matmuls over stacked weights) stay in full precision, and so
does a linear layer whose input width is not a multiple of the group size.

A fake-quantized linear rounds its weight to int4 per group of ``group_size`` input
columns (symmetric, one scale per group) and, for ``int8-int4``, its input to int8 per
token (asymmetric), in the forward pass; the backward pass goes straight through the
rounding. The master weights stay in full precision and keep their names, so checkpoints
do not change. The scales are computed from the tensors every forward: no state besides
the weights, and whether a step fake-quantizes follows from its number
(``precision.qat_start_step``), so a resumed run goes on identically.

After training, the same torchao base config turns the weights into real int4 ones
(``quantize``): what ``llmforge export`` writes (``--quantize``) and post-training
quantization of a plain run does, with the same numbers as the fake-quantized forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from llmforge.config.choices import Qat
from llmforge.parallel.float8 import SKIPPED, quiet_torchao


def base_config(*, scheme: str, group_size: int):
    """torchao's post-training quantization config for ``scheme``: QAT infers its fake
    quantizers from it, and the same config quantizes the trained weights."""
    with quiet_torchao():
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup

    if scheme == Qat.INT8_INT4:
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme == Qat.INT4:
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    raise ValueError(f"unknown QAT scheme {scheme!r} (llmforge.config.qat_rules.QAT_SCHEMES)")


def block_linear_filter(group_size: int) -> Callable[[nn.Module, str], bool]:
    """Quantize a linear layer of a block unless it is the router or its input width is
    not a multiple of ``group_size``."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(part in SKIPPED for part in fqn.split(".")):
            return False
        return module.weight.shape[1] % group_size == 0

    return keep


def apply_qat(model: nn.Module, *, scheme: str, group_size: int) -> int:
    """Swap the linear layers of ``model``'s blocks (a whole model or a pipeline chunk) for
    torchao's FakeQuantizedLinear in place; returns how many were swapped."""
    with quiet_torchao():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    config = QATConfig(base_config(scheme=scheme, group_size=group_size), step="prepare")
    swapped = 0
    for block in model.layers.values():
        quantize_(block, config, filter_fn=block_linear_filter(group_size))
        swapped += sum(isinstance(m, FakeQuantizedLinear) for m in block.modules())
    return swapped


def set_fake_quant(parts: Iterable[nn.Module], *, enabled: bool) -> None:
    """Switch the fake quantization of every FakeQuantizedLinear in ``parts`` on or off."""
    from torchao.quantization.qat.linear import enable_linear_fake_quant

    for part in parts:
        part.apply(lambda m: enable_linear_fake_quant(m, enabled=enabled))


def switch_at(parts: list[nn.Module], *, start_step: int) -> Callable[[int], None]:
    """What the loop runs before each step: fake quantization on from step ``start_step`` (1-based) onwards."""
    state = {"enabled": None}

    def before_step(step: int) -> None:
        enabled = step >= start_step
        if enabled != state["enabled"]:
            set_fake_quant(parts, enabled=enabled)
            state["enabled"] = enabled

    return before_step


def quantize(model: nn.Module, *, scheme: str, group_size: int) -> list[str]:
    """Quantize the blocks' linear layers of a plain or fake-quantized model for real, in
    place, with the scheme's torchao config; returns the names of the quantized layers."""
    with quiet_torchao():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    config = base_config(scheme=scheme, group_size=group_size)
    for block in model.layers.values():
        if any(isinstance(m, FakeQuantizedLinear) for m in block.modules()):
            quantize_(block, QATConfig(config, step="convert"), filter_fn=lambda m, fqn: isinstance(m, FakeQuantizedLinear))
        else:
            quantize_(block, config, filter_fn=block_linear_filter(group_size))
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and _quantized_weight(m.weight)]


def _quantized_weight(weight: torch.Tensor) -> bool:
    """A torchao quantized tensor (a tensor subclass from torchao), not a plain one."""
    data = weight.data if isinstance(weight, nn.Parameter) else weight
    return type(data).__module__.startswith("torchao")
