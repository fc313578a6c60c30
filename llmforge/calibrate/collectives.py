"""Collectives over several ranks, timed the way nccl-tests times them.

Every rank runs the same sweep (``sweep``): all_reduce, all_gather, reduce_scatter,
all_to_all and a ring of send/recv, each over a range of buffer sizes (``size`` is the
whole buffer: the reduced one, the gathered output, the scattered input). The time
of a size is the slowest rank's; algorithm bandwidth is size / time and bus bandwidth
the algorithm bandwidth times 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
reduce_scatter, all_to_all) or 1 (send/recv): the rate each link runs at, which the
estimator's ``intra_node_gbs`` and ``inter_node_gbs`` describe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from llmforge.calibrate.fit import CommSample
from llmforge.calibrate.timing import synchronize

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
MIB = 2**20


#: Sizes below 1 MiB a CPU sweep starts with: gloo's fixed cost per call (``comm_latency_us``)
#: dominates them, as it does the tensor-parallel collectives of a small model.
CPU_SMALL = (4 * 2**10, 64 * 2**10)


def sizes(device: torch.device, *, quick: bool) -> list[int]:
    """1 MiB to 1 GiB on a GPU (to 64 MiB with ``quick``); on a CPU 4 KiB and 64 KiB, then 1 MiB
    to 64 MiB (4 MiB)."""
    top = (64 if quick else 1024) if device.type == "cuda" else (4 if quick else 64)
    out, size = [] if device.type == "cuda" else list(CPU_SMALL), 1
    while size <= top:
        out.append(size * MIB)
        size *= 4
    return out


def _collective(op: str, nbytes: int, *, group, device: torch.device) -> Callable[[], None]:
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    numel = max(n, nbytes // 4 // n * n)
    full, part = torch.ones(numel, device=device), torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full, group=group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    peers = dist.get_process_group_ranks(group)
    to, frm = peers[(rank + 1) % n], peers[(rank - 1) % n]
    recv = torch.empty_like(full)

    def ring() -> None:
        ops = [dist.P2POp(dist.isend, full, to, group=group), dist.P2POp(dist.irecv, recv, frm, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return ring


def time_op(fn: Callable[[], None], *, group, device: torch.device, iters: int) -> float:
    """Seconds per call on the slowest rank (after one warm-up call)."""
    fn()
    synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def sweep(
    *, link: str, group, device: torch.device, byte_sizes: Sequence[int], tick: Callable[[str], None] | None = None
) -> list[CommSample]:
    """Every op at every size on ``group`` (every rank of it calls this)."""
    n = dist.get_world_size(group)
    out = []
    for op in OPS:
        for nbytes in byte_sizes:
            iters = max(2, min(20 if nbytes >= MIB else 100, (64 * MIB) // nbytes))
            seconds = time_op(_collective(op, nbytes, group=group, device=device), group=group, device=device, iters=iters)
            out.append(CommSample(op, link, n, nbytes, seconds))
            if tick:
                tick(f"{op} {nbytes // MIB} MiB ({link}-node, {n} ranks)")
    return out


def groups(*, nodes: int, per_node: int):
    """[(link, group)] this rank sweeps: its node's ranks (when a node has several) and,
    across nodes, the whole world. Every rank creates every node's group, as torch asks."""
    out = []
    if per_node > 1:
        mine = None
        for node in range(nodes):
            g = dist.new_group(list(range(node * per_node, (node + 1) * per_node))) if nodes > 1 else dist.group.WORLD
            if dist.get_rank() // per_node == node:
                mine = g
        out.append(("intra", mine))
    if nodes > 1:
        out.append(("inter", dist.group.WORLD))
    return out


def best_bus_bandwidth(op: str, *, group, device: torch.device, byte_sizes: Sequence[int], iters: int = 5) -> float:
    """The best bus bandwidth (bytes/s) of ``op`` on ``group`` over ``byte_sizes``, each timed on
    the slowest rank: the pre-flight network check (``llmforge.launch.netcheck``). Every rank calls it."""
    n = dist.get_world_size(group)
    times = [
        (nbytes, time_op(_collective(op, nbytes, group=group, device=device), group=group, device=device, iters=iters))
        for nbytes in byte_sizes
    ]
    return max(CommSample(op, "inter", n, nbytes, seconds).busbw for nbytes, seconds in times)
