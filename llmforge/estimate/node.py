"""Host memory of a node: what all the ranks on it keep in host memory, added up.

A node runs ``cluster.devices_per_node`` ranks (else the world split over the nodes); each is counted as the most-loaded one (an
upper bound under a pipeline, whose stages differ). Per rank:

- CPU ranks (``cluster.accelerator=cpu``: the device is the host): the rank's whole
  footprint (the device estimate), its offloaded states and activations (the same memory),
  and the checkpoint staging copy;
- GPU ranks: the process (Python, torch, the CUDA context: ``RANK_BASE_BYTES``), the build
  buffer (the model is built on the meta device and each parameter generated whole in
  fp32 on the host before this rank keeps its shard: the largest single parameter), the
  pinned data buffers, the checkpoint staging copy and the offloaded states and
  activations (``parallel.offload``).

The checkpoint staging copy is this rank's shard of the fp32 weights and AdamW's two
moments (12 bytes per parameter) under ``checkpoint.async_save``, which copies them off
the device before the background write; a synchronous save writes one tensor at a time.

The node's memory is the profile's ``host_memory_gib``; for CPU ranks without one, this
machine's memory (physical, or the cgroup's limit where lower), as a calibration reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmforge.config.choices import Recompute
from llmforge.estimate.params import block_tensors, embedding_tensors, head_tensors
from llmforge.estimate.shape import Job, Shape
from llmforge.layout import Layout

FP32 = 4
INT64 = 8
RANK_BASE_BYTES = 2 * 2**30  # a GPU rank's process on the host: interpreter, torch, CUDA context and libraries
CHECKPOINT_BYTES = 12  # fp32 weight and two fp32 AdamW moments per parameter of the shard
PREFETCHED_BATCHES = 2  # pinned batches a data-parallel rank holds: the one in use and the next


@dataclass(frozen=True)
class NodeMemory:
    """Host memory of the most-loaded node: ``ranks`` ranks of ``per_rank`` bytes each
    (``items``: that rank's bytes by what they are), against ``capacity``."""

    ranks: int
    items: dict[str, float]
    capacity: int
    cpu: bool

    @property
    def per_rank(self) -> float:
        return sum(self.items.values())

    @property
    def total(self) -> float:
        return self.ranks * self.per_rank

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def host_capacity(job: Job) -> int:
    """Host memory of one node: ``Job.host_memory``, else the profile's ``host_memory_gib``."""
    return job.host_memory if job.host_memory is not None else job.profile.host_memory_bytes


def largest_parameter(shape: Shape) -> int:
    """Elements of the model's largest single parameter (built whole before it is sharded)."""
    tensors = embedding_tensors(shape) + head_tensors(shape, separate_copy=True) + list(block_tensors(shape, False))
    if shape.num_experts:
        tensors += list(block_tensors(shape, True))
    return max(t.numel for t in tensors)


def rank_items(
    shape: Shape, layout: Layout, job: Job, *, device_total: float, shard: int, offloaded: float = 0.0, largest: int | None = None
) -> dict[str, float]:
    """Host bytes of one rank by item (``device_total``: the rank's device estimate; ``shard``:
    elements of its parameter shard; ``offloaded``: its offloaded states and activations;
    ``largest``: ``largest_parameter(shape)`` where the caller has it)."""
    staging = CHECKPOINT_BYTES * shard if job.async_checkpoint else 0.0
    if job.on_cpu:
        items = {"rank footprint": device_total}
    else:
        data = PREFETCHED_BATCHES * layout.micro_batch_size * (shape.seq + 1) * INT64
        items = {
            "process": float(RANK_BASE_BYTES),
            "build buffer": FP32 * (largest_parameter(shape) if largest is None else largest),
            "data buffers": float(data),
        }
    if staging:
        items["checkpoint staging"] = staging
    if offloaded:
        items["offloaded"] = offloaded
    return items


def node_memory(
    shape: Shape, layout: Layout, job: Job, *, device_total: float, shard: int, offloaded: float = 0.0, largest: int | None = None
) -> NodeMemory:
    """The most-loaded node's host memory (see the module docstring)."""
    items = rank_items(shape, layout, job, device_total=device_total, shard=shard, offloaded=offloaded, largest=largest)
    return NodeMemory(ranks=ranks_per_node(layout, job), items=items, capacity=host_capacity(job), cpu=job.on_cpu)


def ranks_per_node(layout: Layout, job: Job) -> int:
    """Ranks on one node: ``cluster.devices_per_node``, else the world split over the nodes."""
    per_node = job.devices_per_node or -(-layout.world // max(1, job.nodes))
    return max(1, min(layout.world, per_node))


def words(node: NodeMemory) -> str:
    """'4 ranks x 7.04 GiB = 28.2 GiB of 23.5 GiB host memory per node'."""
    return (
        f"{node.ranks} rank{'s' if node.ranks != 1 else ''} x {node.per_rank / 2**30:,.2f} GiB = "
        f"{node.total / 2**30:,.2f} GiB of the node's {node.capacity / 2**30:,.2f} GiB host memory"
    )


def fix(node: NodeMemory, layout: Layout) -> str:
    """What makes a node's ranks fit its host memory (only the changes the layout lacks)."""
    most = int(node.capacity // node.per_rank) if node.per_rank else node.ranks
    size = f"{node.per_rank / 2**30:,.2f} GiB"
    fewer = f"a node holds at most {most} rank{'s' if most != 1 else ''} of {size}" if most else f"a node holds no rank of {size}"
    lighter = [
        k
        for k, wanted in (
            ("parallel.zero=3", layout.zero < 3),
            ("parallel.recompute=full", layout.recompute != Recompute.FULL),
            ("a smaller train.micro_batch_size", layout.micro_batch_size > 1),
        )
        if wanted
    ]
    if node.cpu:
        out = f"start fewer ranks on each machine ({fewer}: a smaller parallel.dp or cluster.devices_per_node, or more cluster.nodes)"
    else:
        out = (
            f"use nodes with more host memory (the profile's host_memory_gib) or fewer ranks per node ({fewer}: "
            "cluster.devices_per_node), offload less (parallel.offload, parallel.offload_activations) or set checkpoint.async_save=false"
        )
    if lighter:
        out += f", make each rank lighter ({', '.join(lighter)})"
    return out + ", or pass --force"
