"""Every layout computes what one process computes (CPU, gloo, one process per rank).

Each process group runs many layouts in turn (llmforge.testing.harness), so the
whole matrix costs two torchrun starts."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from gloo_runs import run_harness

from llmforge.testing.harness import tiny_plan, train_layout

PP = ["parallel.pp=2"]
V2 = ["parallel.pp_virtual_stages=2"]
# Tiny MoE (4 experts, top-2, one shared expert, seq 16): the expert-parallel layouts
# must compute what one process computes with all experts local (ep=1).
MOE = [
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.ffn_hidden_size=48",
    "model.moe.num_shared_experts=1",
    "model.moe.aux_loss_coef=0.05",
    "model.moe.z_loss_coef=0.01",
    "model.seq_len=16",
]
EP2 = MOE + ["parallel.dp=2", "parallel.ep=2"]
# Auxiliary-loss-free balancing: the routing bias follows the load summed over both ranks.
MOE_BIAS = MOE + ["model.moe.balance=bias", "model.moe.bias_update_rate=0.01"]
DP4_EP2 = MOE + ["parallel.dp=4", "parallel.ep=2"]
CP2 = ["parallel.cp=2"]
# RoPE with grouped-query attention: positions and shared keys under context parallel.
ROPE_GQA = ["model.position=rope", "model.num_kv_heads=2"]
# Llama-style blocks: the fused q/k/v (2 KV groups of 2 q heads per tp rank) and gate/up projections split over tp.
LLAMA = [
    "model.norm=rmsnorm",
    "model.activation=swiglu",
    "model.position=rope",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.bias=false",
]
HSDP = ["parallel.dp=4", "parallel.dp_replicate=2"]
SELECTIVE = "parallel.recompute=selective"
OFFLOAD = ["parallel.offload=states"]
ACTIVATIONS = ["parallel.offload_activations=true"]
# Document masks with positions restarting at each document, RoPE, GQA and a sliding
# window on every second layer (the harness plants end-of-document tokens), and a
# sliding window alone (causal, learned positions): each schedule, cp, ZeRO, tp+sp.
MASKED = [
    "model.attention_mask=document",
    "model.position_reset=true",
    "model.position=rope",
    "model.num_kv_heads=2",
    "model.sliding_window=6",
    "model.sliding_window_every=2",
]
WINDOW = ["model.sliding_window=6"]
MASKED_WORLD2 = {
    "masked_dp2_zero1": MASKED + ["parallel.dp=2", "parallel.zero=1"],
    "masked_dp2_zero3": MASKED + ["parallel.dp=2", "parallel.zero=3"],
    "masked_tp2_sp": MASKED + ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "masked_cp2": MASKED + ["parallel.cp=2"],
    "masked_pp2_gpipe": MASKED + PP + ["parallel.pp_schedule=gpipe"],
    "masked_pp2_1f1b": MASKED + PP + ["parallel.pp_schedule=1f1b"],
    "masked_pp2_interleaved_v2": MASKED + PP + V2 + ["parallel.pp_schedule=interleaved_1f1b"],
    "masked_pp2_looped_bfs": MASKED + PP + V2 + ["parallel.pp_schedule=looped_bfs"],
    "masked_pp2_zb_interleaved": MASKED + PP + V2 + ["parallel.pp_schedule=zb_interleaved"],
    "masked_pp2_zbv": MASKED + PP + V2 + ["parallel.pp_schedule=zbv"],
    "masked_moe_ep2": MASKED + EP2,
    "window_cp2_zero1": WINDOW + CP2 + ["parallel.zero=1"],
    "window_pp2_zbv": WINDOW + PP + V2 + ["parallel.pp_schedule=zbv"],
}
MASKED_WORLD4 = {
    "masked_dp2_tp2_sp_zero3": MASKED + ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=3"],
    "masked_tp2_pp2": MASKED + ["parallel.tp=2"] + PP,
}
WORLD2 = {
    "dp2": ["parallel.dp=2"],
    "dp2_zero1": ["parallel.dp=2", "parallel.zero=1"],
    "dp2_zero2": ["parallel.dp=2", "parallel.zero=2"],
    "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"],
    "tp2": ["parallel.tp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "llama_tp2_sp": LLAMA + ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2_gpipe": PP + ["parallel.pp_schedule=gpipe"],
    "pp2_1f1b": PP + ["parallel.pp_schedule=1f1b"],
    "pp2_interleaved_v2": PP + V2 + ["parallel.pp_schedule=interleaved_1f1b"],
    "pp2_looped_bfs": PP + V2 + ["parallel.pp_schedule=looped_bfs"],
    "pp2_zb_interleaved": PP + V2 + ["parallel.pp_schedule=zb_interleaved"],
    "pp2_zbv": PP + V2 + ["parallel.pp_schedule=zbv"],
    "pp2_uneven_untied": PP + ["parallel.pp_layers=[1,3]", "model.tie_embeddings=false"],
    "moe_ep2": EP2,
    "moe_ep2_zero1": EP2 + ["parallel.zero=1"],
    "moe_ep2_zero3": EP2 + ["parallel.zero=3"],
    "moe_bias_ep2": MOE_BIAS + EP2[len(MOE) :],
    "cp2": CP2,
    "cp2_zero1": CP2 + ["parallel.zero=1"],
    "rope_gqa_cp2_zero3": ROPE_GQA + CP2 + ["parallel.zero=3"],
    # CPU offload (FSDP2 CPUOffloadPolicy, fused CPU AdamW; saved activations through host copies)
    "dp2_zero1_offload": OFFLOAD + ["parallel.dp=2", "parallel.zero=1"],
    "dp2_zero2_offload": OFFLOAD + ["parallel.dp=2", "parallel.zero=2"],
    "dp2_zero3_offload_activations": OFFLOAD + ACTIVATIONS + ["parallel.dp=2", "parallel.zero=3"],
    "cp2_zero1_offload": OFFLOAD + CP2 + ["parallel.zero=1"],
    "moe_ep2_zero3_offload": EP2 + OFFLOAD + ["parallel.zero=3"],
    "pp2_offload_activations": PP + ACTIVATIONS,
    # selective recompute: rebuilt cheap steps under FSDP2's resharding and offloaded activations,
    # op-level checkpointing of tensor-parallel blocks
    "dp2_zero3_selective": ["parallel.dp=2", "parallel.zero=3", SELECTIVE],
    "pp2_offload_activations_selective": PP + ACTIVATIONS + [SELECTIVE],
    "llama_tp2_sp_selective": LLAMA + ["parallel.tp=2", "parallel.sequence_parallel=true", SELECTIVE],
}
WORLD4 = {
    "dp2_tp2": ["parallel.dp=2", "parallel.tp=2"],
    "dp2_tp2_sp_zero1": ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=1"],
    "dp2_tp2_zero3": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"],
    "tp2_pp2": ["parallel.tp=2"] + PP,
    "llama_tp2_sp_pp2": LLAMA + ["parallel.tp=2", "parallel.sequence_parallel=true"] + PP,
    "dp2_pp2": ["parallel.dp=2"] + PP,
    "dp2_pp2_zero2": ["parallel.dp=2", "parallel.zero=2"] + PP,
    "dp2_pp2_zero3_interleaved": ["parallel.dp=2", "parallel.zero=3", "parallel.pp_schedule=interleaved_1f1b"] + PP + V2,
    "moe_dp4_ep2": DP4_EP2,
    "moe_dp4_ep2_zero3": DP4_EP2 + ["parallel.zero=3"],
    "moe_ep2_tp2_sp_zero1": EP2 + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=1"],
    "moe_ep2_pp2": EP2 + PP,
    "dp2_cp2": ["parallel.dp=2"] + CP2,
    # HSDP: 2 replicas x 2-rank shard groups (FSDP2 on a 2-D mesh)
    "hsdp2x2_zero3": HSDP + ["parallel.zero=3"],
    "hsdp2x2_zero1": HSDP + ["parallel.zero=1"],
    "cp2_tp2_sp_zero1": CP2 + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.zero=1"],
    "dp2_tp2_zero3_offload": OFFLOAD + ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"],
    "dp2_pp2_zero2_offload": OFFLOAD + ["parallel.dp=2", "parallel.zero=2"] + PP,
    "hsdp2x2_zero3_offload": OFFLOAD + HSDP + ["parallel.zero=3"],
    # Muon with ZeRO and TP: matrices gathered over dp, orthogonalised by an owner of the tp (or dp) group
    "muon_dp2_tp2_zero3": ["optim.name=muon", "parallel.dp=2", "parallel.tp=2", "parallel.zero=3"],
}
# FP8 (torchao float8, emulated on CPU; fp32 elsewhere so only float8 rounding remains):
# every layout computes the one-process fp8 numbers; ZeRO-3 all-gathers float8 weights.
FP8 = ["precision.fp8=true", "precision.fp8_emulate=true", "precision.fp8_linears=all", "train.steps=3"]
ROWWISE = ["precision.fp8_recipe=rowwise"]
FP8_LAYOUTS = {
    "fp8_dp2": FP8 + ["parallel.dp=2"],
    "fp8_dp2_zero1_rowwise": FP8 + ROWWISE + ["parallel.dp=2", "parallel.zero=1"],
    "fp8_dp2_zero2": FP8 + ["parallel.dp=2", "parallel.zero=2"],
    "fp8_dp2_zero3": FP8 + ["parallel.dp=2", "parallel.zero=3"],
    "fp8_tp2_sp": FP8 + ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "fp8_pp2_rowwise": FP8 + ROWWISE + PP,
}
FP8_WORLD4 = {"fp8_hsdp2x2_zero3": FP8 + HSDP + ["parallel.zero=3"]}
# 16-bit compute: the residual stream in the compute dtype (ZeRO 0 and tensor parallel
# through autocast, ZeRO 1-3 through FSDP2's gathered compute copies, pipeline stages
# exchanging it), or in fp32 with precision.fp32_residual=true.
BF16 = ["precision.param_dtype=bf16"]
MIXED = {
    "tp2_bf16": ["parallel.tp=2", "precision.param_dtype=bf16", "precision.reduce_dtype=bf16"],
    "pp2_fp16": PP + ["precision.param_dtype=fp16"],
    "dp2_zero3_fp16": ["parallel.dp=2", "parallel.zero=3", "precision.param_dtype=fp16"],
    "dp2_zero1_bf16": ["parallel.dp=2", "parallel.zero=1"] + BF16,
    "dp2_bf16": ["parallel.dp=2"] + BF16,
    "pp2_bf16": PP + BF16,
    "dp2_zero3_bf16_fp32_residual": ["parallel.dp=2", "parallel.zero=3", "precision.fp32_residual=true"] + BF16,
}


# Logging every second step: the counted step (3) is not logged and must not wait for the device.
QUIET = ["train.log_interval=2"]
QUIET_WORLD2 = {"quiet_dp2": QUIET + ["parallel.dp=2"], "quiet_pp2": QUIET + PP, "quiet_moe_ep2": QUIET + EP2}
# Layouts whose host synchronisations per step are counted (slow: a Python dispatch mode sees every op).
COUNT_SYNCS = ["dp2_zero3", "tp2_sp", "pp2_1f1b", "dp2_tp2_sp_zero1", *QUIET_WORLD2]


def run_group(tmp: Path, *, nproc: int, layouts: dict, mesh_of_one: bool = False) -> dict:
    # overlapped ZeRO-0 reduction (off by default on CPU) over 20 kB buckets: many buckets of the tiny model
    spec = {
        "base": ["parallel.overlap_grad_reduce=true", "parallel.bucket_mb=0.02"],
        "layouts": layouts,
        "count_syncs": COUNT_SYNCS,
        "mesh_of_one": mesh_of_one,
    }
    return run_harness(tmp, spec, nproc=nproc, name=f"run{nproc}")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("parallel")
    return {
        **run_group(tmp, nproc=2, layouts={**WORLD2, **MIXED, **FP8_LAYOUTS, **MASKED_WORLD2, **QUIET_WORLD2}),
        **run_group(tmp, nproc=4, layouts={**WORLD4, **FP8_WORLD4, **MASKED_WORLD4}),
    }


REFERENCES = {
    "dense": [],
    "untied": ["model.tie_embeddings=false"],
    "moe": MOE,
    "moe_bias": MOE_BIAS,
    "rope_gqa": ROPE_GQA,
    "masked": MASKED,
    "masked_moe": MASKED + MOE,
    "window": WINDOW,
    "muon": ["optim.name=muon"],
    "llama": LLAMA,
}


@pytest.fixture(scope="module")
def reference():
    return {key: train_layout(tiny_plan(list(extra))) for key, extra in REFERENCES.items()}


def reference_of(layout: str) -> str:
    if layout.startswith(("masked_", "window_")):
        return "masked_moe" if layout.startswith("masked_moe") else layout.split("_")[0]
    if layout.startswith("muon_"):
        return "muon"
    if layout.startswith("moe_bias_"):
        return "moe_bias"
    if layout.startswith("moe_"):
        return "moe"
    if layout.startswith("rope_gqa_"):
        return "rope_gqa"
    if layout.startswith("llama_"):
        return "llama"
    return "untied" if "untied" in layout else "dense"


def max_rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=False))


@pytest.mark.parametrize("layout", list(WORLD2) + list(WORLD4) + list(MASKED_WORLD2) + list(MASKED_WORLD4))
def test_layout_matches_single_process(layout, results, reference):
    got = results[layout]
    ref = reference[reference_of(layout)]
    assert len(got["losses"]) == 5
    assert max_rel(got["losses"], ref.losses) < 1e-5
    assert len(got["val_losses"]) == 2 and max_rel(got["val_losses"], ref.val_losses) < 1e-5
    assert max_rel(got["grad_norms"], ref.grad_norms) < 1e-5
    assert set(ref.params) <= set(got["params"])
    for name, value in ref.params.items():
        rel = float((got["params"][name] - value).norm() / value.norm())
        assert rel < 1e-5, f"{name}: relative difference {rel:.2e}"
    if layout.startswith("hsdp2x2"):  # sharded over the 2 ranks of a shard group, not all 4
        assert got["local_numel"]["layers.0.attn.qkv_proj.weight"] == ref.params["layers.0.attn.qkv_proj.weight"].numel() // 2
    if layout.startswith("moe_"):
        held = [n for n in got["local_numel"] if n.endswith("mlp.experts.w_up")]
        assert held and all(2 * got["local_numel"][n] <= ref.params[n].numel() for n in held), "experts were not split over ep ranks"
    if layout.startswith("muon_"):
        return  # Muon's run is held to its own one-process reference above; the checks below are AdamW layouts'
    if layout.startswith("moe_bias_"):
        bias = {n: b for n, b in ref.buffers[0].items() if n.endswith("expert_bias")}
        assert bias and all(b.abs().sum() > 0 for b in bias.values()), "the routing bias did not move"
        for rank_buffers in got["buffers"]:
            for name, value in bias.items():
                torch.testing.assert_close(rank_buffers[name], value, rtol=0, atol=1e-7)
    assert residual_dtypes(got["dtypes"]) == {"torch.float32"}
    if "head.weight" in got["params"] and "head.weight" not in ref.params:
        torch.testing.assert_close(got["params"]["head.weight"], got["params"]["embed.weight"], rtol=0, atol=0)


@functools.cache
def low_precision_reference(overrides: tuple):
    return train_layout(tiny_plan(list(overrides)))


def residual_dtypes(dtypes: list) -> set:
    """The dtypes the blocks of every rank received and returned."""
    return {d for rank in dtypes for key in ("block_inputs", "block_outputs") for d in rank[key]}


@pytest.mark.parametrize("layout", list(MIXED))
def test_low_precision_layouts_follow_single_process(layout, results):
    """Within bf16's rounding of one process (its unit roundoff is 2**-8 = 3.9e-3):
    the same compute dtype, residual stream and fp32 loss on every rank."""
    overrides = tuple(o for o in MIXED[layout] if o.startswith("precision."))
    ref, got = low_precision_reference(overrides), results[layout]
    assert len(got["losses"]) == 5 and all(torch.isfinite(torch.tensor(got["losses"])))
    assert max_rel(got["losses"], ref.losses) < 1e-3
    assert max_rel(got["val_losses"], ref.val_losses) < 1e-3
    assert max_rel(got["grad_norms"], ref.grad_norms) < 1e-2
    for name, value in ref.params.items():
        assert float((got["params"][name] - value).norm() / value.norm()) < 1e-2, name
    compute = "torch.float16" if "precision.param_dtype=fp16" in overrides else "torch.bfloat16"
    expected = "torch.float32" if "precision.fp32_residual=true" in overrides else compute
    assert residual_dtypes(got["dtypes"]) == residual_dtypes(ref.dtypes) == {expected}
    assert {d for rank in got["dtypes"] for d in rank["losses"]} == {"torch.float32"}


@pytest.mark.parametrize("layout", [name for name in COUNT_SYNCS if name not in QUIET_WORLD2])
def test_a_logged_distributed_step_reads_the_device_twice(layout, results):
    """Every step logs here: one read of loss and gradient norm, one of the stop vote, no per-parameter reads."""
    assert results[layout]["syncs"] == [2]  # step 3: logged, not validated
    assert results[layout]["sync_ops"] == [{"aten._local_scalar_dense.default": 1, "tolist": 1}]


@pytest.mark.parametrize("layout", list(QUIET_WORLD2))
def test_a_step_that_is_not_logged_never_waits_for_the_device(layout, results, reference):
    """No stop vote, no MoE capacity read, no pipeline shape exchange; the logged steps' losses are
    one process's. Expert parallelism alone reads the all-to-all's split sizes (two per MoE layer
    and microbatch: each rank's counts for every other, and what it sends)."""
    got = results[layout]
    assert max_rel(got["losses"], [reference[reference_of(layout.removeprefix("quiet_"))].losses[i] for i in (1, 3, 4)]) < 1e-5
    if layout == "quiet_moe_ep2":  # 16 reads here: 4 layers, 2 microbatches
        assert set(got["sync_ops"][0]) <= {"tolist"}
    else:
        assert got["syncs"] == [0]


@pytest.fixture(scope="module")
def fp8_reference():
    return {recipe: train_layout(tiny_plan(FP8 + [f"precision.fp8_recipe={recipe}"])) for recipe in ("tensorwise", "rowwise")}


@pytest.mark.parametrize("layout", list(FP8_LAYOUTS) + list(FP8_WORLD4))
def test_fp8_layouts_match_single_process_fp8(layout, results, fp8_reference):
    got = results[layout]
    ref = fp8_reference["rowwise" if "rowwise" in layout else "tensorwise"]
    # Tensor parallel splits matmuls, so sums run in another order: a last-bit change
    # can round an element to the neighbouring float8 value. Other layouts are exact.
    tol = 2e-3 if "tp2" in layout else 1e-5
    assert len(got["losses"]) == 3
    assert max_rel(got["losses"], ref.losses) < tol
    if "tp2" not in layout:
        assert max_rel(got["grad_norms"], ref.grad_norms) < tol
        for name, value in ref.params.items():
            assert float((got["params"][name] - value).norm() / value.norm()) < tol, name
