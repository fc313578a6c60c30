"""A compiled float8 block under selective recompute: one graph, no break, and a backward that
reruns no float8 matmul and no absolute maximum. torchao's real float8 path runs on CPU (torch
has a CPU ``_scaled_mm``); the graphs are read from AOT autograd's forward and backward."""

from __future__ import annotations

import collections

import pytest
import torch

from llmforge.blockspec.fp8 import fp8_choice_of
from llmforge.parallel.recompute import apply_recompute
from llmforge.testing.harness import tiny_plan
from llmforge.train.build import build_model

pytest.importorskip("torchao")

SMALL = ["model.num_layers=1", "model.hidden_size=64", "model.ffn_hidden_size=256", "model.seq_len=32", "model.vocab_size=256"]
SCALED_MM, AMAX = "aten._scaled_mm.default", "aten.max.default"


def float8_block(*, recompute: str) -> torch.nn.Module:
    """The first block of a one-layer model, its four linears float8 (not emulated)."""
    from llmforge.parallel.float8 import convert_blocks, float8_config

    plan = tiny_plan([*SMALL, "precision.fp8_linears=all"])
    model = build_model(plan, device=torch.device("cpu"))
    config = float8_config(recipe="tensorwise", emulate=False, fsdp_all_gather=False)
    assert convert_blocks(model, choice=fp8_choice_of(plan.config), config=config) == 4
    apply_recompute(model, mode=recompute, compiled=True)
    return model.layers["0"]


def step(block: torch.nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
    out.float().square().mean().backward()


def compiled_graphs(block: torch.nn.Module) -> dict[str, collections.Counter[str]]:
    """Compile ``block`` (AOT autograd with the partitioner Inductor uses, the graphs run as they
    are) and run one step; the aten ops of its forward and backward graphs."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: dict[str, collections.Counter[str]] = {}

    def record(kind: str):
        def compiler(gm, example_inputs):
            graphs[kind] = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm

        return compiler

    def backend(gm, example_inputs):
        fw, bw = record("forward"), record("backward")
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, bw_compiler=bw, partition_fn=min_cut_rematerialization_partition)

    block.compile(backend=backend)
    step(block)
    return graphs


def test_a_compiled_float8_block_under_selective_recompute_reruns_no_float8_matmul_or_amax():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    plain = compiled_graphs(float8_block(recompute="none"))  # nothing recomputed: the ops one step needs
    counters.clear()
    graphs = compiled_graphs(float8_block(recompute="selective"))
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    forward, backward = graphs["forward"], graphs["backward"]
    assert forward[SCALED_MM] == 4 and backward[SCALED_MM] == 2 * 4  # each linear's two gradient matmuls, no rerun
    assert forward[AMAX] + backward[AMAX] == plain["forward"][AMAX] + plain["backward"][AMAX] > 0  # no scale computed twice
