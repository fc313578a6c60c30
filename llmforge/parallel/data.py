"""Data parallelism and the ZeRO stages, and what each really shards.

- ZeRO 0: every rank holds the whole (tensor/pipeline-local) model, gradients and
  optimizer states; gradients are all-reduced over the data-parallel group in
  ``precision.reduce_dtype``, as DDP does: in buckets (``BucketedGradReduce``),
  each launched asynchronously during the last microbatch's backward as soon as
  its gradients are ready, and waited for after backward. Under pipeline
  parallelism the schedule runs (and rescales) the backward itself, so there the
  gradients are all-reduced after it (``GradAllReduce``, one flat buffer).
- ZeRO 1, 2, 3 use FSDP2 ``fully_shard`` per transformer block and on the root.
  The sharded parameters are the fp32 master weights (the optimizer steps them),
  sharded with the AdamW moments in every stage. Forward and backward use
  compute copies in ``precision.param_dtype`` (``MixedPrecisionPolicy``): the
  all-gathers move that dtype and gradients are reduce-scattered in
  ``precision.reduce_dtype``; the blocks' inputs, the residual stream, are cast
  to it too unless ``precision.fp32_residual`` (``llmforge.parallel.residual``).
  As the ZeRO paper's stages:
  - 1: the compute weights stay whole through the step's microbatches and
    gradients accumulate whole (in the reduce dtype), reduce-scattered once,
    during the last microbatch's backward;
  - 2: as 1, but gradients are reduce-scattered during every microbatch's
    backward, so only a gradient shard is kept;
  - 3: compute weights are freed after each block's forward and gathered again
    for its backward (and for every microbatch).
  Each block prefetches the next block's gather in forward and the previous one's
  in backward (``set_modules_to_forward_prefetch``/``backward_prefetch``), and
  each block's reduce-scatter runs while backward goes on to the blocks before it.
  Under pipeline parallelism the pipeline schedule keeps the weights gathered and
  gradients whole until a stage's last microbatch, so stages 1 and 2 behave alike
  there. On CUDA FSDP2 runs every reduce-scatter on its own stream, so block i's
  runs while blocks i-1, ... compute their backward. On gloo FSDP2 calls it
  synchronously and the host waits for each: for ZeRO 1 with fp32 reduction
  (``defer``, ``parallel.overlap_grad_reduce``) ``DeferredReduceScatter`` launches
  them asynchronously instead and the step waits for all after backward. Otherwise on
  CPU ranks ``ReleasingReduceScatter`` frees each reduce-scatter's input (a block's
  gradients) once it returns, where FSDP2 would keep it until the next one.
Expert weights (``parallel.ep`` > 1) are already split over the ep ranks, so they
are reduced, and ZeRO-sharded, over ``dp_rest`` only: the data-parallel ranks
that hold replicas of the same experts. Their gradient is the sum over those
ranks divided by the whole data-parallel size (each rank's loss is its own mean),
so ZeRO 0 divides by dp after the replica all-reduce, and ZeRO 1-3 put each
MoE layer's experts in their own FSDP2 unit on the ``dp_rest`` mesh with a
gradient divide factor of dp. That unit shards each expert weight on dim 0 (the
local experts) when they split evenly over ``dp_rest``, otherwise on a later
dimension that does (``expert_placement``): with 8 experts over ep 8 and 4
replicas, each rank holds a quarter of its one expert, not the whole of it padded.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor, Shard

from llmforge.layout import expert_shard_dim
from llmforge.parallel.dtensor import local
from llmforge.parallel.expert import ExpertParallelExperts


def mixed_precision(*, param_dtype: torch.dtype, reduce_dtype: torch.dtype, fp32_residual: bool = False) -> MixedPrecisionPolicy:
    """Gather weights in ``param_dtype`` and reduce gradients in ``reduce_dtype``.

    Each unit's floating-point inputs (a block's residual stream, a pipeline
    stage's received activations) are cast to ``param_dtype``, as torchtitan
    does, unless ``fp32_residual``: then the stream stays fp32 and the compute
    copies meet it in autocast (``llmforge.parallel.residual`` casts the
    embedding lookups up)."""
    compute = None if param_dtype == torch.float32 else param_dtype
    return MixedPrecisionPolicy(
        param_dtype=compute, reduce_dtype=reduce_dtype, cast_forward_inputs=compute is not None and not fp32_residual
    )


def apply_fsdp(
    model: nn.Module,
    *,
    dp_mesh: DeviceMesh,
    zero: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    expert_mesh: DeviceMesh | None = None,
    offload: bool = False,
    fp32_residual: bool = False,
    defer: bool = False,
    release_reduce_input: bool = False,
) -> DeferredReduceScatter | None:
    """Shard ``model`` over ``dp_mesh`` with FSDP2 for ZeRO stage 1, 2 or 3.

    ``expert_mesh`` (the ``dp_rest`` mesh, set when experts are split over ep
    ranks) shards each MoE layer's expert weights over the replicas of the same
    experts, with gradients divided by the whole data-parallel size. ``offload``:
    the sharded fp32 weights and their gradients live in host memory (FSDP2's
    ``CPUOffloadPolicy``, pinned when the mesh is on GPUs), so the optimizer steps
    them on the CPU. ``defer`` (ZeRO 1 on gloo, fp32 reduction, no offload, no HSDP:
    ``can_defer_reduce``) launches the blocks' and the root's reduce-scatters without
    waiting; the returned ``DeferredReduceScatter`` waits for them (after backward).
    ``release_reduce_input`` (CPU ranks; a rehearsal of a GPU rank on CPU tensors keeps what
    CUDA keeps): otherwise each reduce-scatter frees its input when it returns."""
    mp = mixed_precision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, fp32_residual=fp32_residual)
    policy = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if offload else OffloadPolicy()
    blocks = []
    for i, block in enumerate(model.layers.values()):
        # ZeRO 3 keeps the last block gathered: its backward comes right after its forward
        reshard = zero == 3 and i + 1 < len(model.layers)
        if expert_mesh is not None:
            _shard_experts(block, mesh=expert_mesh, dp_size=dp_mesh.size(), reshard=reshard, mp=mp, policy=policy)
        blocks.append(fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=policy))
    # The root (embedding, final norm, output layer) stays gathered after forward under every stage:
    # the output layer's backward runs first, right after the forward ends.
    root = fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=policy)
    _prefetch(blocks)
    if blocks:  # the root issues the first block's gather before the embedding computes
        root.set_modules_to_forward_prefetch([blocks[0]])
    if not defer:
        if release_reduce_input and dp_mesh.device_type == "cpu":
            for unit in [*blocks, root]:
                unit.set_custom_reduce_scatter(ReleasingReduceScatter())
        return None
    deferred = DeferredReduceScatter()
    for unit in [*blocks, root]:
        unit.set_custom_reduce_scatter(deferred)
    _DEFERRED[model] = deferred
    return deferred


_DEFERRED: weakref.WeakKeyDictionary[nn.Module, DeferredReduceScatter] = weakref.WeakKeyDictionary()


def reshard_gathered(parts: Sequence[nn.Module]) -> None:
    """Put every FSDP module of ``parts`` back on its sharded parameters. A forward with no
    backward (validation) leaves the modules that keep their gathered weights after forward
    (ZeRO 1/2, and ZeRO 3's root and last block) holding them, float8 ones under fp8 all-gather."""
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def deferred_reduce(model: nn.Module) -> DeferredReduceScatter | None:
    """The deferred reduce-scatters ``apply_fsdp(defer=True)`` gave ``model``, if any."""
    return _DEFERRED.get(model)


def can_defer_reduce(*, device_type: str, zero: int, reduce_dtype: torch.dtype, offload: bool, replicated: bool, experts: bool) -> bool:
    """Whether FSDP2 leaves a reduce-scatter's output untouched until the step waits for it:
    its fp32 result becomes the sharded gradient as it is (no cast, no division after it,
    no accumulation into an earlier gradient: ZeRO 1 reduces once per step into gradients
    set to None; no HSDP all-reduce, no copy to the host; expert units divide after it).
    Only gloo needs it: on CUDA FSDP2's reduce-scatter stream already overlaps."""
    return device_type == "cpu" and zero == 1 and reduce_dtype == torch.float32 and not (offload or replicated or experts)


class _GlooReduceScatter(ReduceScatter):
    """FSDP2's custom reduce-scatter hook on gloo: plain buffers, the collective in ``__call__``."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class ReleasingReduceScatter(_GlooReduceScatter):
    """FSDP2's reduce-scatter as it runs on gloo (the same collective, synchronous), which then
    frees its input buffer. FSDP2 keeps the last unit's input (a whole block's gradients) until
    the next unit's reduce-scatter, so that a CUDA stream cannot reuse it too early; on a CPU
    the collective has finished when the call returns and the buffer only holds memory."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op, async_op: bool = False):
        work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, op=op, group=group, async_op=async_op)
        if work is not None:
            work.wait()
        input_tensor.untyped_storage().resize_(0)
        return None


class DeferredReduceScatter(_GlooReduceScatter):
    """FSDP2's reduce-scatter launched with ``async_op`` on gloo, so the host goes on with
    the backward of the blocks before while gloo's thread reduces; ``wait`` (after
    backward, before anything reads the gradients) waits for every launched one.
    ``trace``, when a list, records one entry per launched reduce-scatter (its input numel)."""

    def __init__(self, trace: list[int] | None = None) -> None:
        self._pending: list[tuple[object, torch.Tensor, torch.Tensor]] = []
        self.trace = trace

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op, async_op: bool = False):
        work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, op=op, group=group, async_op=True)
        # both buffers stay referenced until the wait: FSDP2 may drop its input buffer at once
        self._pending.append((work, output_tensor, input_tensor))
        if self.trace is not None:
            self.trace.append(input_tensor.numel())
        return None

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for work, _, _ in pending:
            work.wait()  # type: ignore[attr-defined]


def _prefetch(blocks: list[FSDPModule]) -> None:
    """Each block issues the next block's all-gather in forward and the previous
    block's in backward, so gathers run while the current block computes."""
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


def _shard_experts(
    block: nn.Module, *, mesh: DeviceMesh, dp_size: int, reshard: bool, mp: MixedPrecisionPolicy, policy: OffloadPolicy
) -> None:
    for module in list(block.modules()):
        if isinstance(module, ExpertParallelExperts):
            unit = fully_shard(
                module,
                mesh=mesh,
                reshard_after_forward=reshard,
                mp_policy=mp,
                offload_policy=policy,
                shard_placement_fn=expert_placement(group=mesh.size()),
            )
            unit.set_gradient_divide_factor(float(dp_size))
            if mesh.device_type == "cpu" and mesh.size() > 1:
                # gloo has no PREMUL_SUM. (On one rank FSDP2 divides without a
                # collective, and forcing sums there would divide twice.)
                unit.set_force_sum_reduction_for_comms(True)


def expert_placement(*, group: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP2's placement of each expert weight over ``group`` ranks: ``Shard`` on
    ``llmforge.layout.expert_shard_dim`` of its ep-local shape, so that with fewer local
    experts than ranks each rank holds 1/group of them instead of one padded expert."""
    return lambda param: Shard(expert_shard_dim(local(param.detach()).shape, group=group))


@contextlib.contextmanager
def fsdp_sync(model: nn.Module, *, zero: int, last: bool) -> Iterator[None]:
    """One microbatch under ZeRO ``zero`` (1-3): stages 1 and 2 keep the gathered
    compute weights after backward unless ``last``; stage 1 also suspends the
    gradient reduce-scatter (gradients accumulate whole) unless ``last``."""
    assert isinstance(model, FSDPModule)
    if zero < 3:
        model.set_reshard_after_backward(last)
    if zero == 1:
        model.set_requires_gradient_sync(last)
    try:
        yield
    finally:
        model.set_reshard_after_backward(True)
        model.set_requires_gradient_sync(True)


@dataclass
class GradAllReduce:
    """ZeRO 0 after backward (pipeline parallel, CPU by default, or ``parallel.overlap_grad_reduce=false``): sum
    gradients over ``group`` and divide by ``size``, in ``dtype``
    (the data-parallel group and size; for expert weights the ``dp_rest`` group
    and the data-parallel size)."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup
    size: int
    dtype: torch.dtype

    def __call__(self) -> None:
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        for kind in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == kind]
            flat = torch.cat([g.reshape(-1) for g in same]).to(self.dtype)
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.size)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


BUCKET_BYTES = 25 * 2**20
# As DDP: a small first bucket (the last layers' gradients, ready first) starts
# communication early in the backward.
FIRST_BUCKET_BYTES = 2**20


def plan_buckets(sizes: Sequence[int], *, bucket_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    """Parameter indices grouped into buckets, in reverse parameter order (the order
    backward produces gradients). ``sizes`` are the bytes each parameter sends; a
    bucket closes when the next parameter would take it past its cap."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(sizes))):
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if current and filled + sizes[index] > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += sizes[index]
    if current:
        buckets.append(current)
    return buckets


@dataclass
class _Launched:
    flat: torch.Tensor
    work: object
    numels: list[int]


@dataclass
class BucketedGradReduce:
    """ZeRO 0 with the reduction overlapped with backward: sum gradients over
    ``group`` and divide by ``size``, in ``dtype``, bucket by bucket.

    While armed (the last microbatch's backward, see ``grad_sync``), a
    post-accumulate-grad hook marks each parameter ready; buckets are launched
    (``async_op``) strictly in bucket order as soon as all their gradients are
    ready, so every rank issues the same collectives in the same order. ``finish``
    launches what is left (buckets holding a parameter that got no gradient in this
    microbatch), waits, divides and copies the results back into the gradients.
    A parameter without a gradient on this rank is sent as zeros; the last bucket
    also carries one "has a gradient" flag per parameter, so a parameter that has a
    gradient on some rank gets the average on every rank, and one without a
    gradient anywhere keeps none (as in one process). ``trace``, when a list,
    records ``("ready", param index)`` and ``("launch", bucket index)`` events."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup
    size: int
    dtype: torch.dtype
    bucket_bytes: int = BUCKET_BYTES
    first_bucket_bytes: int = FIRST_BUCKET_BYTES
    trace: list[tuple[str, int]] | None = None
    buckets: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        element = torch.tensor([], dtype=self.dtype).element_size()
        sizes = [local(p).numel() * element for p in self.params]
        self.buckets = plan_buckets(sizes, bucket_bytes=self.bucket_bytes, first_bucket_bytes=self.first_bucket_bytes)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._armed = False
        self._reset()
        for index, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, index=index: self._ready(index))

    def _reset(self) -> None:
        self._pending = [set(bucket) for bucket in self.buckets]
        self._launched: list[_Launched] = []

    def arm(self, *, armed: bool) -> None:
        """Reduce during the coming backward (the step's last microbatch) or only accumulate."""
        if armed and not self._armed:
            self._reset()
        self._armed = armed

    def _ready(self, index: int) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[index]
        if bucket < len(self._launched):
            raise RuntimeError(f"parameter {index} received a gradient after its bucket was reduced")
        if self.trace is not None:
            self.trace.append(("ready", index))
        self._pending[bucket].discard(index)
        while len(self._launched) < len(self.buckets) and not self._pending[len(self._launched)]:
            self._launch()

    def _launch(self) -> None:
        b = len(self._launched)
        pieces = [_grad_or_zeros(self.params[i]) for i in self.buckets[b]]
        numels = [t.numel() for t in pieces]
        flat_parts = [t.reshape(-1).to(self.dtype) for t in pieces]
        if b == len(self.buckets) - 1:
            flat_parts.append(torch.tensor([float(p.grad is not None) for p in self.params], dtype=self.dtype, device=pieces[0].device))
        flat = torch.cat(flat_parts)
        if self.trace is not None:
            self.trace.append(("launch", b))
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._launched.append(_Launched(flat=flat, work=work, numels=numels))

    def __call__(self) -> None:
        """Launch the buckets not launched during backward, wait for all, write back."""
        if not self.buckets:
            return
        try:
            while len(self._launched) < len(self.buckets):
                self._launch()
            for launched in self._launched:
                launched.work.wait()  # type: ignore[attr-defined]
            flags = self._launched[-1].flat[sum(self._launched[-1].numels) :]
            for bucket, launched in zip(self.buckets, self._launched, strict=False):
                self._write_back(bucket, launched, flags)
        finally:
            self._armed = False
            self._reset()

    def _write_back(self, bucket: list[int], launched: _Launched, flags: torch.Tensor) -> None:
        flat = launched.flat
        flat[: sum(launched.numels)].div_(self.size)
        offset = 0
        for i, numel in zip(bucket, launched.numels, strict=False):
            p, part = self.params[i], flat[offset : offset + numel]
            offset += numel
            if p.grad is not None:
                local(p.grad).copy_(part.view_as(local(p.grad)))
            elif flags[i] > 0:
                p.grad = _like_param(p, part)


def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    """The local gradient, or zeros of the parameter's local shape when it has none."""
    return local(p.grad) if p.grad is not None else torch.zeros_like(local(p.detach()))


def _like_param(p: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
    """A gradient for ``p`` holding ``values`` (its local part when ``p`` is a DTensor)."""
    shard = values.to(p.dtype).view_as(local(p.detach())).clone()
    if isinstance(p, DTensor):
        return DTensor.from_local(shard, device_mesh=p.device_mesh, placements=p.placements, shape=p.shape, stride=p.stride())
    return shard


@contextlib.contextmanager
def grad_sync(reducers: Sequence[BucketedGradReduce], *, sync: bool) -> Iterator[None]:
    """Arm the bucketed reductions for the backward in the block when ``sync``
    (the last microbatch); earlier microbatches only accumulate."""
    for reducer in reducers:
        reducer.arm(armed=sync)
    try:
        yield
    finally:
        for reducer in reducers:
            reducer.arm(armed=False)
