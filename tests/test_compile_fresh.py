"""A model compiles from a fresh dynamo state. dynamo's caches are per code object and every
model's blocks share one ``forward``: without a fresh state, a model built after another one in
the same process (another micro batch, as the GPU report's rows follow each other) gets graphs
with symbolic sizes instead of the static graphs a run in its own process gets."""

from __future__ import annotations

import pytest
import torch

from llmforge.testing.harness import tiny_plan
from llmforge.train.build import build_parts

pytest.importorskip("torchao")

FP8 = ["precision.param_dtype=bf16", "precision.fp8=true", "precision.fp8_emulate=true", "precision.fp8_linears=all", "train.compile=true"]
SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.seq_len=16"]


def symbolic_inputs_of_a_step(*, micro_batch: int, graphs: list[int]) -> list[int]:
    """Build a compiled float8 model, run one forward and backward; how many symbolic sizes each
    block graph compiled for it takes."""
    plan = tiny_plan([*SMALL, *FP8, f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={micro_batch}"])
    (model,), _ = build_parts(plan, mesh=None, device=torch.device("cpu"))
    start = len(graphs)
    tokens = torch.randint(0, plan.config.model.vocab_size, (micro_batch, plan.config.model.seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    logits.float().mean().backward()
    return graphs[start:]


def test_a_model_built_after_another_compiles_static_graphs(monkeypatch):
    graphs: list[int] = []

    def recording(gm, example_inputs):
        graphs.append(sum(isinstance(i, torch.SymInt) for i in example_inputs))
        return gm.forward

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **_: compile_module(self, backend=recording))
    first = symbolic_inputs_of_a_step(micro_batch=4, graphs=graphs)
    second = symbolic_inputs_of_a_step(micro_batch=2, graphs=graphs)
    assert first and second  # the blocks compiled for each model
    assert first == second == [0] * len(first)
