"""One rank through torchrun trains every strategy that fits on one device (ZeRO 1-3
forced through FSDP2, recompute, bf16/fp16, compile, MoE) as the same plan does in
one process. All layouts run in one started process group (llmforge.testing.harness)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from gpu_support import DEVICES, LOW_PRECISION_REL, accelerator, child_env

from llmforge.testing.harness import tiny_plan, train_layout

pytestmark = pytest.mark.gpu

MOE = [
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.ffn_hidden_size=48",
    "model.moe.num_shared_experts=1",
    "model.moe.aux_loss_coef=0.05",
    "model.seq_len=16",
]
LAYOUTS = {
    "single": [],
    "zero1": ["parallel.zero=1"],
    "zero2": ["parallel.zero=2"],
    "zero3": ["parallel.zero=3"],
    "recompute_selective": ["parallel.recompute=selective"],
    "recompute_full": ["parallel.recompute=full"],
    "compile": ["train.compile=true"],
    "moe": MOE,
    "moe_zero3": MOE + ["parallel.zero=3"],
    "bf16": ["precision.param_dtype=bf16"],
    "bf16_zero3_bf16_reduce": ["precision.param_dtype=bf16", "precision.reduce_dtype=bf16", "parallel.zero=3"],
    "fp16": ["precision.param_dtype=fp16"],
    "fp16_zero2": ["precision.param_dtype=fp16", "parallel.zero=2"],
}
LOW_PRECISION = {name for name, overrides in LAYOUTS.items() if any("precision." in o for o in overrides)}


def base(device: str) -> list:
    # ZeRO 0 reduces in buckets during backward (the GPU default) over tiny buckets
    return [f"cluster.accelerator={accelerator(device)}", "parallel.overlap_grad_reduce=true", "parallel.bucket_mb=0.02"]


@pytest.fixture(scope="module", params=DEVICES)
def layouts(request, tmp_path_factory):
    """(device, what each layout computed through torchrun with one rank)."""
    device = request.param
    tmp = tmp_path_factory.mktemp(f"layouts-{device}")
    spec, out = tmp / "spec.json", tmp / "out.pt"
    spec.write_text(json.dumps({"base": base(device), "layouts": LAYOUTS, "device": device, "mesh_of_one": True}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "llmforge.testing.harness",
        str(spec),
        str(out),
    ]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return device, torch.load(out, weights_only=False)


def rel(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=False))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_rank_through_torchrun_computes_what_one_process_computes(layouts, name):
    device, results = layouts
    got = results[name]
    ref = train_layout(tiny_plan(base(device) + LAYOUTS[name]), device=torch.device(device))
    assert len(got["losses"]) == 5 and all(torch.isfinite(torch.tensor(got["losses"])))
    if name in LOW_PRECISION:
        assert rel(got["losses"], ref.losses) < LOW_PRECISION_REL, (got["losses"], ref.losses)
        return
    tolerance = 1e-5 if device == "cpu" else 1e-4  # GPU kernels (attention backward) are not bit-deterministic
    assert rel(got["losses"], ref.losses) < tolerance, (got["losses"], ref.losses)
    assert rel(got["grad_norms"], ref.grad_norms) < 10 * tolerance, (got["grad_norms"], ref.grad_norms)
    for key, value in ref.params.items():
        assert float((got["params"][key] - value).norm() / value.norm()) < 10 * tolerance, key
