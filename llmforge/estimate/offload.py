"""CPU offload in the estimate: ``parallel.offload=states`` and ``parallel.offload_activations``.

``states`` is FSDP2's ``CPUOffloadPolicy`` (llmforge.parallel.data): each rank's shard of
the fp32 master weights, their gradients and AdamW's two moments (16 bytes per sharded
parameter) live in host memory, and the optimizer step runs on the CPU. What stays on
the device:

- the compute copy of the weights: whole through the step under ZeRO 1 and 2 (and any
  stage under a pipeline), one gathered block (and the prefetched next one) at a time
  under ZeRO 3, plus the fp32 shard of one block copied up before its all-gather;
- the gradients: whole (reduce dtype) where ZeRO 1 or a pipeline accumulates them,
  else one block's, reduce-scattered and copied down as backward produces them.

``offload_activations`` copies every activation saved for backward to host memory in
forward and back in backward: the device keeps the block being computed and the one
in transit (two blocks' share of a microbatch's saved activations).

Step time gains three terms. The copies over the host link (``host_link_gbs`` per
device and direction, both directions at once): the fp32 shard up at every gather
(twice per microbatch under ZeRO 3, once per step otherwise), the gradient shard down
at every reduce-scatter, and the saved activations down and up; compute hides them
but for the first block's transfer of each pass and the gradient shards that FSDP2
copies down synchronously to add them to the host's (ZeRO 2 and 3, every microbatch
after the first): ``offload_copy`` is what compute does not hide. The CPU AdamW step with the gradient clip and the host-side gradient
accumulation moves bytes over the node's host memory, shared by its devices, at
``HOST_ADAM_EFFICIENCY`` of ``host_memory_bandwidth_gbs`` (``cpu_optimizer``).
Host memory per node is every device's offloaded states and activations, checked
against ``host_memory_gib``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmforge.config.choices import Offload
from llmforge.config.dtypes import DTYPE_BYTES
from llmforge.estimate.allocator import slack_fraction
from llmforge.estimate.inventory import Inventory
from llmforge.estimate.node import host_capacity
from llmforge.estimate.pipeline import inflight_microbatches
from llmforge.estimate.shape import Job
from llmforge.estimate.stage_memory import StageMemory
from llmforge.layout import Layout

FP32 = 4
STATE_BYTES = 16  # fp32 master weight, fp32 gradient, two fp32 AdamW moments
#: fused CPU AdamW (torch's fused=True) over its bytes, as a share of the host's memory bandwidth:
#: tools/bench_cpu_adamw.py measured 0.70 of a plain copy on 2 threads; a many-core NUMA host reaches less
HOST_ADAM_EFFICIENCY = 0.5
ADAM_BYTES = 28  # reads weight, gradient, two moments; writes weight and moments
CLIP_BYTES = 4  # the gradient norm reads every gradient once
ACCUMULATE_BYTES = 12  # host gradient accumulation: reads two fp32 values, writes one


def offloads(layout: Layout) -> bool:
    return layout.offload != Offload.NONE or layout.offload_activations


@dataclass(frozen=True)
class HostUse:
    """The host side of an offloaded layout, for the most-loaded device and its node."""

    states_bytes: float  # offloaded model states of one device
    activations_bytes: float  # offloaded saved activations of one device
    node_bytes: float  # host memory the node's devices need together
    node_capacity: int
    copy_s: float  # host-link transfers of one step
    exposed_copy_s: float  # the part compute does not hide
    optimizer_s: float  # CPU AdamW step, clip and host accumulation

    @property
    def fits(self) -> bool:
        return self.node_bytes <= self.node_capacity


def device_memory(mem: StageMemory, inv: Inventory, job: Job) -> StageMemory:
    """``mem`` with the offloaded parts moved off the device."""
    layout = inv.layout
    if layout.offload == Offload.STATES:
        mem = _states_off(mem, layout, job, block=inv.largest_block(mem.stage))
    if layout.offload_activations:
        blocks = max(1, inv.counts(mem.stage).blocks)
        kept = min(mem.activations, 2 * mem.activations / blocks)
        mem = dataclasses.replace(mem, activations=kept, reserved=mem.reserved - slack_fraction(job) * (mem.activations - kept))
    return mem


def _states_off(mem: StageMemory, layout: Layout, job: Job, *, block: float) -> StageMemory:
    full = mem.params
    whole_copy = layout.zero < 3 or layout.pp > 1
    whole_grads = layout.zero == 1 or layout.pp > 1
    rb = DTYPE_BYTES[job.reduce_dtype]
    weights = job.compute_bytes * full if whole_copy else 0.0
    grads = rb * full if whole_grads else 0.0
    transient = mem.transient
    group = layout.dp_shard * layout.cp
    if group == 1:  # FSDP2 over one rank: the gathers and block gradients the unsharded count left out
        transient += block * (job.compute_bytes + rb) + (2 * block * job.compute_bytes if not whole_copy else 0.0)
    transient += FP32 * block / group  # one block's fp32 shard copied up for its all-gather
    return dataclasses.replace(
        mem,
        weights=weights,
        grads=grads,
        optimizer=0.0,
        transient=transient,
        reserved=mem.reserved + slack_fraction(job) * (transient - mem.transient),
    )


def host_use(inv: Inventory, job: Job, *, stage: int, activations: float, microbatches: int, compute_s: float) -> HostUse:
    """Host memory, link transfers and CPU optimizer time of the inventory's layout (``stage``:
    the most-loaded one; ``activations``: its saved activations before offload; ``compute_s``:
    the step's compute)."""
    layout = inv.layout
    shard: float = inv.stages[stage].shard if layout.offload == Offload.STATES else 0
    m = microbatches
    gathers = 2 * m if layout.zero == 3 and layout.pp == 1 else 1
    scatters = m if layout.zero >= 2 and layout.pp == 1 else 1
    bandwidth = job.profile.host_link_bandwidth
    up = FP32 * shard * gathers
    down = DTYPE_BYTES[job.reduce_dtype] * shard * scatters
    # a gradient shard that adds to the one already on the host is copied down synchronously
    # (FSDP2 waits for it before the CPU add): not hidden
    blocking_s = DTYPE_BYTES[job.reduce_dtype] * shard * (scatters - 1) / bandwidth
    held = activations if layout.offload_activations else 0.0
    per_step = held / inflight_microbatches(layout, stage=stage, microbatches=m) * m if held else 0.0
    up, down = up + per_step, down + per_step
    copy_s = max(up, down) / bandwidth
    blocks = max(1, inv.counts(stage).blocks)
    overlapped = copy_s - blocking_s
    exposed = blocking_s + max(0.0, overlapped - compute_s) + overlapped / (2 * m * blocks) if copy_s else 0.0
    devices = min(layout.world, job.node_size)
    host_bytes = shard * (ADAM_BYTES + CLIP_BYTES + ACCUMULATE_BYTES * (scatters - 1))
    optimizer_s = devices * host_bytes / (job.profile.host_memory_bandwidth * HOST_ADAM_EFFICIENCY)
    per_device = STATE_BYTES * shard + held
    return HostUse(
        states_bytes=STATE_BYTES * shard,
        activations_bytes=held,
        node_bytes=devices * per_device,
        node_capacity=host_capacity(job),
        copy_s=copy_s,
        exposed_copy_s=exposed,
        optimizer_s=optimizer_s,
    )
