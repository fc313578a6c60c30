"""Each rank's shards, built on the meta device and filled one parameter at a time, hold the
values a whole model's parameters have at those offsets, and a pipeline's last stage holds the
embedding's values in its tied copy of the output layer. Each rank builds every layout over
torch's fake process group (building needs no collective) in a process of its own: DTensor's
sharding caches compare meshes by shape, so a second rank in one process would reuse the first's."""

from __future__ import annotations

import json
import subprocess
import sys

LAYOUTS = {
    "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"],
    "tp2": ["parallel.tp=2"],
    "pp2_tied": ["parallel.pp=2", "model.tie_embeddings=true"],
}

RANK = """
import json, sys, warnings
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from llmforge.models.gpt import GPT
from llmforge.rehearse.fake import fake_process_group
from llmforge.testing.harness import tiny_plan
from llmforge.train.build import build_parts, distributed_rank

warnings.simplefilter("ignore")  # the fake group takes no collective timeout
rank, report = int(sys.argv[1]), {}
for layout, overrides in json.loads(sys.argv[2]).items():
    plan = tiny_plan(["model.position=rope", *overrides])
    reference = GPT(plan.config.model)
    reference.init_weights(seed=plan.config.train.seed)
    whole = {name: p.detach() for name, p in reference.named_parameters()}
    if plan.config.model.tie_embeddings and plan.layout.pp > 1:
        whole["head.weight"] = whole["embed.weight"]  # the last stage's copy of the tied embedding
    report[layout] = {"checked": [], "wrong": [], "all": sorted(whole)}
    with fake_process_group(rank=rank, world_size=2):
        parts, _ = build_parts(plan, mesh=distributed_rank(plan, device=torch.device("cpu")).mesh, device=torch.device("cpu"))
        for part in parts:
            for name, param in part.named_parameters():
                expected = whole[name]
                if isinstance(param, DTensor):  # this rank's block, as distribute_tensor cuts it
                    expected = distribute_tensor(expected, param.device_mesh, param.placements, src_data_rank=None).to_local()
                    param = param.to_local()
                report[layout]["checked"].append(name)
                if not torch.equal(param, expected):
                    report[layout]["wrong"].append(name)
print(json.dumps(report))
"""


def test_each_rank_builds_the_whole_models_values_at_its_offsets():
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), json.dumps(LAYOUTS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    reports = []
    for process in ranks:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for layout in LAYOUTS:
        assert [r[layout]["wrong"] for r in reports] == [[], []], layout
        checked = {name for r in reports for name in r[layout]["checked"]}
        assert checked == set(reports[0][layout]["all"]), layout  # every parameter, the tied copy included, on one rank or both
