"""torch.compile applied per transformer block, as torchtitan does.

Blocks are compiled in place (``nn.Module.compile``), so parameter names, and with
them checkpoints, stay the same. Compiling block by block keeps graphs small,
lets identical blocks share one compiled graph, and leaves the places where
parallelism hooks in (FSDP units, pipeline stage boundaries) outside the graphs.

A model's compiled code starts from a fresh dynamo state. dynamo keeps its caches per code
object for the whole process, and every model's blocks run the same ``forward``: a block seen
before at another micro batch, sequence length or width makes dynamo compile the next model's
blocks with symbolic sizes (automatic dynamic shapes), which is slower (and, with float8
linears, much slower) than the static graphs one run in its own process gets. A process that
trains several models in turn (a benchmark's rows, tests) would otherwise measure the slow graphs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_compile(model: nn.Module) -> None:
    """Compile every transformer block of ``model`` (a whole model or a pipeline chunk), from a fresh
    dynamo state (compiling is lazy: another pipeline chunk of the same model loses nothing)."""
    torch._dynamo.reset()
    for block in model.layers.values():
        block.compile()


def apply_async_tp(tp_mesh: DeviceMesh) -> None:
    """Async tensor parallel (``parallel.async_tp``), as torchtitan enables it: Inductor's
    micro-pipeline TP pass rewrites, in the compiled blocks, matmul + reduce-scatter and
    all-gather + matmul into chunked ops over symmetric memory, whose chunks' transfers
    run under the other chunks' matmuls. It needs CUDA and compiled blocks (the plan
    refuses it elsewhere); the flag is process-wide, so it is set only when asked."""
    import torch._inductor.config as inductor
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
