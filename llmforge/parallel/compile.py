"""torch.compile applied per transformer block, as torchtitan does.

Blocks are compiled in place (``nn.Module.compile``), so parameter names, and with
them checkpoints, stay the same. Compiling block by block keeps graphs small,
lets identical blocks share one compiled graph, and leaves the places where
parallelism hooks in (FSDP units, pipeline stage boundaries) outside the graphs.
"""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module) -> None:
    """Compile every transformer block of ``model`` (a whole model or a pipeline chunk)."""
    for block in model.layers.values():
        block.compile()
