"""Newton-Schulz orthogonalisation of matrices that may be sharded over ranks.

The iteration needs each matrix whole. A matrix whose shards sit on the ranks of
one mesh dimension (FSDP2's ZeRO shards on dim 0, tensor parallelism's Shard(0) or
Shard(1)) is given to one rank of that group, its *owner*: the matrices of a
group are dealt out largest first to the least-loaded rank, every rank sends its
shard to the owner (``gather``), the owners orthogonalise in parallel, and each
scatters the result's shards back (``scatter``). A rank receives whole only the
matrices it owns. Matrices held whole (one process, ZeRO 0, pipeline stages,
expert weights split over experts) are orthogonalised where they are; expert
weights ``[E, ...]`` are a batch of E matrices. A matrix sharded over more than one
mesh dimension (ZeRO with TP) is first all-gathered over all but the largest
dimension that cuts it by plain ``Shard``, then takes the owner route over that one;
where none does, every rank of its mesh gathers it whole and orthogonalises it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

#: Keller Jordan's quintic coefficients, as torch.optim.Muon uses them.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(x: torch.Tensor, *, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An approximately orthogonal matrix with ``x``'s singular vectors (the last two
    dimensions are the matrix; leading ones are a batch)."""
    a, b, c = NS_COEFFICIENTS
    tall = x.size(-2) > x.size(-1)
    y = x.to(dtype)
    if tall:
        y = y.mT
    y = y / (torch.linalg.matrix_norm(y, keepdim=True) + NS_EPS)
    for _ in range(steps):
        gram = y @ y.mT
        y = a * y + (b * gram + c * (gram @ gram)) @ y
    if tall:
        y = y.mT
    return y.to(x.dtype)


@dataclass
class Matrix:
    """One parameter's update to orthogonalise: this rank's shard and how it is laid out."""

    local: torch.Tensor
    like: torch.Tensor  # the parameter (a DTensor when sharded): its mesh, placements, global shape
    owner: int = -1  # group rank that orthogonalises it (owner route only)
    received: list[torch.Tensor] = field(default_factory=list)
    result: torch.Tensor | None = None
    #: ``local`` (whole matrices here), ``owner`` (sharded over one mesh dimension) or ``gather_all``
    route: str = field(init=False)
    #: the mesh dimension that shards it (owner route)
    mesh_dim: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        self.route = self._route()

    def _route(self) -> str:
        like = self.like
        if not isinstance(like, DTensor):
            return "local"
        mesh = like.device_mesh
        sharded = [i for i, p in enumerate(like.placements) if not isinstance(p, Replicate) and mesh.size(i) > 1]
        if all(isinstance(like.placements[i], Shard) and like.placements[i].dim % like.ndim < like.ndim - 2 for i in sharded):
            return "local"  # not sharded, or split over whole experts only
        if len(sharded) > 1 or type(like.placements[sharded[0]]) is not Shard:
            return "gather_all"
        self.mesh_dim = sharded[0]
        return "owner" if self._chunked() else "gather_all"

    @property
    def dim(self) -> int:
        return self.like.placements[self.mesh_dim].dim % self.like.ndim

    @property
    def group(self) -> dist.ProcessGroup:
        return self.like.device_mesh.get_group(self.mesh_dim)

    def _chunked(self) -> bool:
        """The shards are torch.chunk's pieces (as DTensor and FSDP2 cut them)."""
        mesh = self.like.device_mesh
        size, n, rank = self.like.shape[self.dim], mesh.size(self.mesh_dim), mesh.get_local_rank(self.mesh_dim)
        return self.local.size(self.dim) == chunk_size(size, n=n, rank=rank)


def chunk_size(size: int, *, n: int, rank: int) -> int:
    """Rows rank ``rank`` of ``n`` holds of ``size`` cut by torch.chunk (the last ranks may hold fewer or none)."""
    chunk = -(-size // n)
    return max(0, min(size, (rank + 1) * chunk) - rank * chunk)


def orthogonalize(matrices: list[Matrix], *, steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each matrix's orthogonalised update, as this rank's shard of it (collective over
    the groups the matrices are sharded over: every rank of a group passes the same
    matrices in the same order)."""
    narrowed = {id(m): _narrowed(m) for m in matrices if m.route == "gather_all"}
    owned = [m for m in matrices if m.route == "owner"] + [n for n in narrowed.values() if n is not None]
    _assign_owners(owned)
    _wait([_send_to_owner(m) for m in owned])
    for m in matrices:
        if m.route == "local":
            m.result = newton_schulz(m.local, steps=steps, dtype=dtype)
        elif m.route == "gather_all" and narrowed[id(m)] is None:
            m.result = _everywhere(m, steps=steps, dtype=dtype)
    for m in owned:
        if _is_owner(m):
            whole = torch.cat(m.received, dim=m.dim).narrow(m.dim, 0, m.like.shape[m.dim])
            m.received = [newton_schulz(whole, steps=steps, dtype=dtype)]
    _wait([_scatter_from_owner(m) for m in owned])
    for m in matrices:
        if narrowed.get(id(m)) is not None:
            m.result = _reshard(narrowed[id(m)].result, like=narrowed[id(m)].like, to=m.like)
    return [m.result for m in matrices]  # type: ignore[misc]


def _narrowed(m: Matrix) -> Matrix | None:
    """A matrix sharded over several mesh dimensions (ZeRO with TP), all-gathered over all but
    the largest that splits it by plain ``Shard``: a matrix for the owner route over that one
    (each of the other dimensions' coordinates repeats it). None where no dimension qualifies."""
    like = m.like
    mesh = like.device_mesh
    keep = [i for i, p in enumerate(like.placements) if type(p) is Shard and mesh.size(i) > 1]
    if not keep:
        return None
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # strided shards: two gathers, warned of each time
    kept = max(keep, key=lambda i: (mesh.size(i), -i))
    target = [p if i == kept else Replicate() for i, p in enumerate(like.placements)]
    sharded = DTensor.from_local(m.local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
    partial = sharded.redistribute(mesh, target)
    out = Matrix(local=partial.to_local(), like=partial)
    return out if out.route == "owner" else None


def _reshard(local: torch.Tensor, *, like: torch.Tensor, to: torch.Tensor) -> torch.Tensor:
    """This rank's shard under ``to``'s placements of what is laid out as ``like`` (a local slice: no communication)."""
    moved = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
    return moved.redistribute(to.device_mesh, to.placements).to_local()


def _assign_owners(owned: list[Matrix]) -> None:
    """Per group: largest matrix first, to the rank with the fewest elements so far."""
    by_group: dict[int, list[Matrix]] = {}
    for m in owned:
        by_group.setdefault(id(m.group), []).append(m)
    for members in by_group.values():
        load = [0] * dist.get_world_size(members[0].group)
        for m in sorted(members, key=lambda m: -m.like.numel()):  # stable: ties keep parameter order
            m.owner = min(range(len(load)), key=lambda r: (load[r], r))
            load[m.owner] += m.like.numel()


def _is_owner(m: Matrix) -> bool:
    return dist.get_rank(m.group) == m.owner


def _padded_shape(m: Matrix) -> tuple[int, ...]:
    shape = list(m.like.shape)
    shape[m.dim] = chunk_size(shape[m.dim], n=dist.get_world_size(m.group), rank=0)
    return tuple(shape)


def _send_to_owner(m: Matrix):
    padded = m.local.new_zeros(_padded_shape(m))
    padded.narrow(m.dim, 0, m.local.size(m.dim)).copy_(m.local)
    n = dist.get_world_size(m.group)
    m.received = [torch.empty_like(padded) for _ in range(n)] if _is_owner(m) else []
    dst = dist.get_global_rank(m.group, m.owner)
    return dist.gather(padded, m.received if _is_owner(m) else None, dst=dst, group=m.group, async_op=True)


def _scatter_from_owner(m: Matrix):
    n = dist.get_world_size(m.group)
    out = m.local.new_empty(_padded_shape(m))
    pieces = None
    if _is_owner(m):
        whole = m.received[0]
        pieces = []
        for rank in range(n):
            start = min(whole.size(m.dim), rank * out.size(m.dim))
            piece = out.new_zeros(out.shape)
            rows = chunk_size(whole.size(m.dim), n=n, rank=rank)
            piece.narrow(m.dim, 0, rows).copy_(whole.narrow(m.dim, start, rows))
            pieces.append(piece)
    m.result = out.narrow(m.dim, 0, m.local.size(m.dim))
    m.received = []
    src = dist.get_global_rank(m.group, m.owner)
    return dist.scatter(out, pieces, src=src, group=m.group, async_op=True)


def _everywhere(m: Matrix, *, steps: int, dtype: torch.dtype) -> torch.Tensor:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    like = m.like
    sharded = DTensor.from_local(m.local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
    whole = newton_schulz(sharded.full_tensor(), steps=steps, dtype=dtype)
    replicated = DTensor.from_local(whole, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return _reshard(whole, like=replicated, to=like)


def _wait(works) -> None:
    for work in works:
        work.wait()
