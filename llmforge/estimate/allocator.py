"""The allocator's slack: memory a rank holds beyond its live tensors, as a fraction of its
activations and transient buffers (shared by the memory estimate and the offload model)."""

from __future__ import annotations

from llmforge.estimate.shape import Job

FRAGMENTATION = 0.10  # of activations and transient buffers: caching-allocator slack
#: Of activations and transient buffers on a CPU rank: the freed memory glibc's heap keeps
#: between the blocks it reuses (llmforge.processes.host_memory), at the step's peak.
CPU_HEAP_SLACK = 0.25


def slack_fraction(job: Job) -> float:
    """The allocator's slack, as a fraction of activations and transient buffers."""
    return CPU_HEAP_SLACK if job.on_cpu else FRAGMENTATION
