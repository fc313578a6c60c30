"""A rank allocates only its share while it builds: the model is built on the meta device,
sharded there, and only this rank's shards are allocated and initialised, one whole
parameter at a time (llmforge.parallel.materialize). Each rank's peak during the build is
measured with torch's memory tracker and held to its shards plus the largest parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._tools.mem_tracker import MemTracker

from llmforge.parallel.dtensor import local
from llmforge.testing.harness import tiny_plan
from llmforge.train.build import build_model, build_parts, distributed_rank

pytestmark = pytest.mark.slow

#: A model whose blocks outweigh its largest single parameter many times over.
SHAPE = [
    "model.num_layers=8",
    "model.hidden_size=128",
    "model.num_heads=4",
    "model.ffn_hidden_size=512",
    "model.vocab_size=512",
    "model.seq_len=32",
]
#: Bytes a build may hold beyond its shards and one whole parameter: the RoPE tables,
#: the MoE state and the small copies a slice is cut through.
ALLOWANCE = 256 * 1024

LAYOUTS = {
    "dp4_zero3": (4, ["parallel.dp=4", "parallel.zero=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
}


def _peak_bytes(build) -> tuple[int, object]:
    tracker = MemTracker()
    with tracker:
        result = build()
    peak = tracker.get_tracker_snapshot("peak")
    return int(peak.get(torch.device("cpu"), {}).get("Total", 0)), result


def _rank(rank: int, world: int, overrides: list, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        plan = tiny_plan(SHAPE + overrides)
        info = distributed_rank(plan, device=torch.device("cpu"))
        peak, (parts, _) = _peak_bytes(lambda: build_parts(plan, mesh=info.mesh, device=torch.device("cpu")))
        shards = sum(local(p).numel() * local(p).element_size() for part in parts for p in part.parameters())
        largest = max(p.numel() * 4 for part in parts for p in part.parameters())
        torch.save({"peak": peak, "shards": shards, "largest": largest}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _whole_model_bytes() -> int:
    model = build_model(tiny_plan(SHAPE), device=torch.device("meta"))
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_builds_within_its_shards_and_one_whole_parameter(tmp_path: Path, layout: str):
    world, overrides = LAYOUTS[layout]
    out = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(world, overrides, str(tmp_path / "store"), out), nprocs=world, start_method="spawn")
    whole = _whole_model_bytes()
    for rank in range(world):
        got = torch.load(f"{out}.{rank}")
        assert got["shards"] < whole, "the layout shards nothing: the check would prove nothing"
        assert got["peak"] <= got["shards"] + got["largest"] + ALLOWANCE, (rank, got, whole)
        assert got["peak"] < 0.75 * whole, (rank, got, whole)


def test_a_model_built_on_meta_has_the_seeded_values_of_a_whole_one():
    plan = tiny_plan(["model.position=rope", "model.tie_embeddings=false"])
    built = build_model(plan, device=torch.device("cpu"))
    from llmforge.models.gpt import GPT

    reference = GPT(plan.config.model)
    reference.init_weights(seed=plan.config.train.seed)
    for (name, a), (_, b) in zip(built.named_parameters(), reference.named_parameters(), strict=False):
        assert torch.equal(a, b), name
    assert torch.equal(built.rope_cos, reference.rope_cos) and torch.equal(built.rope_sin, reference.rope_sin)


@pytest.mark.parametrize("shape", [(16, 6), (10, 6)])
def test_each_rank_cuts_the_slice_distribute_tensor_gives_it(shape):
    """``copy_slice`` takes this rank's block of the whole value as a view (no copy of every
    rank's piece, which FSDP over TP on one dimension would concatenate): the same values as
    ``distribute_tensor``, for every rank of a 2 x 2 mesh, even and uneven sizes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from llmforge.parallel.materialize import local_piece
    from llmforge.rehearse.fake import fake_process_group, fake_tensors

    whole = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    for placements in ([_StridedShard(0, split_factor=2), Shard(0)], [Shard(0), Shard(1)], [Replicate(), Shard(0)]):
        for rank in range(4):
            with fake_process_group(rank=rank, world_size=4):
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
                param = distribute_tensor(torch.empty(shape), mesh, placements, src_data_rank=None)
                expected = distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
                assert torch.equal(local_piece(param, whole), expected), (placements, rank)
                with fake_tensors():  # as a rehearsal cuts it
                    assert local_piece(param, torch.empty(shape)).shape == expected.shape
