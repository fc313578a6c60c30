"""The pre-flight network check (``cluster.network_check``): before a multi-node run trains,
every rank times an all-reduce over the whole world at a few sizes, as ``llmforge
calibrate`` times the inter-node link, and the run is refused when the best bus bandwidth
is below ``cluster.network_min_fraction`` of what the hardware profile says the link
achieves (``inter_node_gbs`` x ``comm_efficiency``, the rate the estimate uses). "4 nodes
as fast as 1" is most often NCCL on TCP sockets instead of InfiniBand or EFA; a few seconds
here catch it before a long job.

``network_problem`` (the verdict) needs no torch; ``check_network`` measures.
"""

from __future__ import annotations

import os

from llmforge.calibrate.collectives import best_bus_bandwidth
from llmforge.errors import Problem, UserError
from llmforge.hardware import get_profile
from llmforge.plan import RunPlan

MIB = 2**20


def nodes_in(plan: RunPlan) -> int:
    """The nodes this world spans (an elastic run may have fewer than cluster.nodes)."""
    per_node = plan.config.cluster.devices_per_node
    return plan.world_size // per_node if per_node else plan.config.cluster.nodes


def wanted(plan: RunPlan) -> bool:
    """On across nodes: asked for, or by default on accelerators (a CPU profile describes no network)."""
    c = plan.config.cluster
    if nodes_in(plan) < 2:
        return False
    return c.network_check if c.network_check is not None else c.accelerator != "cpu"


def expected_bandwidth(plan: RunPlan) -> float:
    """Bytes/s of bus bandwidth the profile's inter-node link achieves."""
    profile = get_profile(plan.config.cluster.accelerator)
    return profile.inter_node_bandwidth * profile.comm_efficiency


def _causes() -> str:
    found = [f"{k}={os.environ[k]} is set here" for k in ("NCCL_IB_DISABLE", "NCCL_NET", "NCCL_SOCKET_IFNAME") if os.environ.get(k)]
    causes = [
        "NCCL's transport fell back to TCP sockets (NCCL_DEBUG=INFO prints NET/Socket instead of NET/IB or NET/OFI)",
        "NCCL_SOCKET_IFNAME picks a slow or wrong interface",
        "the InfiniBand/EFA plugin is missing from the image (aws-ofi-nccl for EFA, the RDMA devices and libibverbs for IB)",
        "NCCL_IB_DISABLE=1 turns InfiniBand off",
    ]
    return "; ".join(causes) + (f" ({', '.join(found)})" if found else "")


def network_problem(plan: RunPlan, *, measured: float) -> Problem | None:
    """The refusal when ``measured`` (bus bandwidth, bytes/s) is below the plan's fraction of the profile's link."""
    c = plan.config.cluster
    expected = expected_bandwidth(plan)
    if measured >= c.network_min_fraction * expected:
        return None
    return Problem(
        "cluster.network_check",
        c.network_check,
        f"an all-reduce across the {nodes_in(plan)} nodes reached {measured / 1e9:.3g} GB/s of bus bandwidth, "
        f"below {c.network_min_fraction:g} x the {expected / 1e9:.3g} GB/s that profile {c.accelerator} expects between nodes "
        f"(inter_node_gbs x comm_efficiency). Likely causes: {_causes()}",
        "fix the nodes' network setup and run again; or lower cluster.network_min_fraction, or measure the link "
        "(llmforge calibrate with cluster.nodes) and use that profile, or skip the check with cluster.network_check=false",
    )


def _sizes(device) -> list[int]:
    return [m * MIB for m in ((16, 64, 256) if device.type == "cuda" else (1, 4))]


def measure_bus_bandwidth(device) -> float:
    """The best all-reduce bus bandwidth over the world at a few sizes (bytes/s). Collective."""
    import torch.distributed as dist

    return best_bus_bandwidth("all_reduce", group=dist.group.WORLD, device=device, byte_sizes=_sizes(device))


def check_network(plan: RunPlan, *, device, console) -> None:
    """Measure and judge (every rank, so that every rank stops on a refusal); rank 0 prints the figure."""
    if not wanted(plan):
        return
    measured = measure_bus_bandwidth(device)
    problem = network_problem(plan, measured=measured)
    if problem is not None:
        raise UserError([problem], title="the network between the nodes is too slow for this profile")
    console.print(
        f"network check: all-reduce across {nodes_in(plan)} nodes at {measured / 1e9:.3g} GB/s bus bandwidth "
        f"(profile {plan.config.cluster.accelerator}: {expected_bandwidth(plan) / 1e9:.3g} GB/s)",
        highlight=False,
    )
