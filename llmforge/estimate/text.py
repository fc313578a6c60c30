"""Estimates in words: byte sizes, the fit verdict, the most-loaded rank, durations."""

from __future__ import annotations

from llmforge.estimate.core import Estimate
from llmforge.estimate.node import words
from llmforge.hardware import GIB


def gib(n: float) -> str:
    """Bytes as GiB text."""
    return f"{n / GIB:,.2f} GiB"


def verdict(est: Estimate) -> str:
    """'fits, 12.3 GiB headroom (15%) ...', or what does not fit: the device, the offloaded
    states' host memory or the node's host memory (all its ranks together)."""
    cap = est.job.profile.memory_bytes
    host, node = est.host, est.node
    over = node if node is not None and not node.fits else None
    over_node = f"; and the node does not fit either: {words(over)}" if over is not None else ""
    if est.headroom < 0:
        return f"does not fit: {gib(-est.headroom)} over the {gib(cap)} of a {est.job.profile.name}{over_node}"
    if host is not None and not host.fits:
        return (
            f"does not fit: the offloaded states need {gib(host.node_bytes)} of host memory per node, "
            f"{gib(host.node_bytes - host.node_capacity)} over the {gib(host.node_capacity)} of the profile's host_memory_gib"
        )
    if over is not None:
        return f"does not fit the node: {words(over)}, {gib(over.total - over.capacity)} over"
    offloaded = f"; host memory {gib(host.node_bytes)} of {gib(host.node_capacity)} per node" if host is not None else ""
    on_node = f"; node host memory {gib(node.total)} of {gib(node.capacity)}" if node is not None else ""
    return f"fits, {gib(est.headroom)} headroom ({est.headroom / cap:.0%} of {gib(cap)}){offloaded}{on_node}"


def where(est: Estimate) -> str:
    """Which rank is the most loaded, in words."""
    lay = est.layout
    parts = [f"pipeline stage {est.worst.stage}"] if lay.pp > 1 else []
    parts += [f"{n} rank 0" for n, v in (("tp", lay.tp), ("ep", lay.ep), ("dp", lay.dp)) if v > 1]
    return ", ".join(parts) or "the only device"


def duration(seconds: float) -> str:
    """A step time as text: milliseconds below a second."""
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"
