"""Each rank's shards, built on the meta device and filled one parameter at a time, hold the
values a whole model's parameters have at those offsets, and a pipeline's last stage holds the
embedding's values in its tied copy of the output layer. Both ranks of each layout are built in
this process over torch's fake process group (building needs no collective)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from llmforge.models.gpt import GPT
from llmforge.rehearse.fake import fake_process_group
from llmforge.testing.harness import tiny_plan
from llmforge.train.build import build_parts, distributed_rank

LAYOUTS = {
    "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"],
    "tp2": ["parallel.tp=2"],
    "pp2_tied": ["parallel.pp=2", "model.tie_embeddings=true"],
}


@pytest.mark.filterwarnings("ignore:Set timeout is now only supported")  # the fake group takes no timeout
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_builds_the_whole_models_values_at_its_offsets(layout):
    plan = tiny_plan(["model.position=rope", *LAYOUTS[layout]])
    reference = GPT(plan.config.model)
    reference.init_weights(seed=plan.config.train.seed)
    whole = {name: p.detach() for name, p in reference.named_parameters()}
    if plan.config.model.tie_embeddings and plan.layout.pp > 1:
        whole["head.weight"] = whole["embed.weight"]  # the last stage's copy of the tied embedding
    checked = set()
    for rank in (0, 1):
        with fake_process_group(rank=rank, world_size=2):
            parts, _ = build_parts(plan, mesh=distributed_rank(plan, device=torch.device("cpu")).mesh, device=torch.device("cpu"))
            for part in parts:
                for name, param in part.named_parameters():
                    expected = whole[name]
                    if isinstance(param, DTensor):  # this rank's block, as distribute_tensor cuts it
                        expected = distribute_tensor(expected, param.device_mesh, param.placements, src_data_rank=None).to_local()
                        param = param.to_local()
                    assert torch.equal(param, expected), (rank, name)
                    checked.add(name)
    assert checked == set(whole)  # every parameter, the tied copy included, on one rank or both
