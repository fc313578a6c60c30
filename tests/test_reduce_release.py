"""A CPU rank frees each ZeRO reduce-scatter's input (a block's gradients) once the
collective returns: FSDP2 keeps the last one until the next, for CUDA streams only.
One process stands for rank 0 of two over torch's fake process group."""

from __future__ import annotations

import dataclasses

import torch

from llmforge.plan import RunPlan
from llmforge.rehearse.fake import FakeBatches, fake_process_group
from llmforge.testing.harness import tiny_plan
from llmforge.train.build import build_components, distributed_rank


def _kept_reduce_inputs(plan: RunPlan) -> list:
    """Bytes of each reduce-scatter input FSDP2 holds on to after its collective, over the second step."""
    with fake_process_group(rank=0, world_size=plan.world_size):
        rank = distributed_rank(plan, device=torch.device("cpu"))
        cfg = plan.config
        c = build_components(
            plan,
            rank=rank,
            sampler=FakeBatches(global_batch=cfg.train.global_batch_size, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size),
        )
        kept: list = []

        class Recording(list):  # FSDP2 appends each reduce-scatter's state once the call returned
            def append(self, state) -> None:
                kept.append(state.reduce_scatter_input.untyped_storage().nbytes())
                super().append(state)

        c.step(c.sampler.next_batch(dp_rank=0, dp_size=plan.world_size))  # FSDP2 sets its state up in the first
        for group in c.model_parts[0]._get_fsdp_state()._fsdp_param_groups:
            group.comm_ctx.reduce_scatter_states = Recording()
        c.step(c.sampler.next_batch(dp_rank=0, dp_size=plan.world_size))
        return kept


def test_a_cpu_rank_keeps_no_reduce_scatter_input_after_backward():
    kept = _kept_reduce_inputs(tiny_plan(["parallel.dp=2", "parallel.zero=3"]))
    assert kept and not any(kept), kept


def test_a_rehearsed_gpu_rank_keeps_what_fsdp2_keeps():
    """The rehearsal of a GPU rank runs on CPU tensors: it keeps the input, as CUDA ranks do."""
    plan = tiny_plan(["parallel.dp=2", "parallel.zero=3"])
    gpu = RunPlan.build(dataclasses.replace(plan.config, cluster=dataclasses.replace(plan.config.cluster, accelerator="h100-80gb")))
    assert any(_kept_reduce_inputs(gpu))
