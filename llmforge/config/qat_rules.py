"""Cross-field rules of quantization-aware training (``precision.qat``).

Part of ``RunPlan.build()``'s checks (every problem reported at once): what torchao's QAT
has no configuration for is refused here, with the key and the fix. No torch.
"""

from __future__ import annotations

from llmforge.config.choices import Qat
from llmforge.config.schema import RunConfig
from llmforge.errors import Problem

#: precision.qat: none, or a scheme (llmforge.config.choices.Qat).
QAT_SCHEMES = Qat.names()


def check_qat(config: RunConfig) -> list[Problem]:
    pr = config.precision
    if pr.qat == Qat.NONE:
        if pr.qat_start_step != 0:
            return [
                Problem(
                    "precision.qat_start_step",
                    pr.qat_start_step,
                    "switches quantization-aware training on at a step, and precision.qat is none",
                    "also set precision.qat=int8-int4 (or int4), or remove precision.qat_start_step",
                )
            ]
        return []
    if pr.qat not in QAT_SCHEMES:
        return []  # a choice problem (llmforge.plan.CHOICES)
    out: list[Problem] = []
    if pr.fp8:
        out.append(
            Problem(
                "precision.qat",
                pr.qat,
                "torchao has no QAT configuration over float8 training (precision.fp8): both replace the blocks' linear layers",
                "train with precision.fp8=false (precision=bf16) for QAT, or set precision.qat=none",
            )
        )
    if config.parallel.tp > 1:
        out.append(
            Problem(
                "precision.qat",
                pr.qat,
                "torchao's fake quantization cannot take tensor-parallel (DTensor) weights: its per-group scales reshape the sharded "
                "weight",
                "use data parallelism (parallel.dp, ZeRO 0-3) and pipeline parallelism for QAT, or set parallel.tp=1",
            )
        )
    if pr.qat_start_step > config.train.steps:
        out.append(
            Problem(
                "precision.qat_start_step",
                pr.qat_start_step,
                f"is after the last step (train.steps={config.train.steps}): the run would never fake-quantize",
                f"set precision.qat_start_step={max(1, config.train.steps * 4 // 5)} (for the last fifth; at most train.steps)",
            )
        )
    out.extend(_group_problems(config))
    return out


def _group_problems(config: RunConfig) -> list[Problem]:
    """At least one of the blocks' linear layers must take the group size (its input width a multiple of it)."""
    m, size = config.model, config.precision.qat_group_size
    widths = {"model.hidden_size": m.hidden_size, "model.ffn_hidden_size": m.ffn_hidden_size}
    if size < 1 or any(w % size == 0 for w in widths.values()):
        return []
    shown = ", ".join(f"{k}={v}" for k, v in widths.items())
    return [
        Problem(
            "precision.qat_group_size",
            size,
            f"divides no linear layer's input width ({shown}), so nothing would be quantized",
            f"set precision.qat_group_size={fitting_group_size(size, widths=tuple(widths.values()))}",
        )
    ]


def fitting_group_size(size: int, *, widths: tuple[int, ...]) -> int:
    """The group size nearest below ``size`` that divides an input width: of the first width
    (model.hidden_size, the input of most linear layers) unless that leaves groups under 8 columns."""
    target = size if size > 0 else 32
    best = [max((d for d in range(1, min(target, width) + 1) if width % d == 0), default=1) for width in widths]
    return best[0] if best[0] >= min(8, max(best)) else max(best)
