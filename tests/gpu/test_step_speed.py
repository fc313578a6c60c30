"""The step's cost on a GPU: fused AdamW, host synchronisations, the chunked loss's
memory, selective recompute keeping the CUDA attention kernel's outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from gpu_support import child_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda", 0)


def test_one_process_is_fused_and_reads_the_device_only_when_it_logs():
    from test_step_cost import _components, _syncs_per_step

    from llmforge.testing.harness import tiny_plan

    c = _components(tiny_plan(["model.num_layers=1"]), CUDA)
    assert c.optimizer.defaults["fused"]
    per_step, records = _syncs_per_step(CUDA, steps=5, log_interval=2)
    assert per_step == [1, 0, 1, 1] and [r["step"] for r in records] == [2, 4, 5]
    assert {"mfu", "peak_allocated_gib", "peak_reserved_gib"} <= records[-1].keys()


def test_the_distributed_path_reads_the_device_once_per_logged_step(tmp_path):
    """One rank through torchrun, NCCL and a device mesh: the clip's all-reduce and the loss stay on the GPU."""
    spec, out = tmp_path / "spec.json", tmp_path / "out.pt"
    spec.write_text(json.dumps({"layouts": {"single": []}, "device": "cuda", "mesh_of_one": True, "count_syncs": ["single"]}))
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
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert torch.load(out, weights_only=False)["single"]["syncs"] == [1]


def test_the_chunked_loss_matches_and_needs_a_fraction_of_the_memory():
    from llmforge.train.loss import cross_entropy

    logits = torch.randn(2, 2048, 50304, device=CUDA).bfloat16().requires_grad_()
    targets = torch.randint(0, 50304, (2, 2048), device=CUDA)
    peaks, grads, values = [], [], []
    for fn in (lambda: cross_entropy(logits, targets), lambda: F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())):
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append(logits.grad.float())
        values.append(float(loss))
    assert values[0] == pytest.approx(values[1], rel=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=1e-7)
    assert peaks[0] < 0.5 * peaks[1], peaks


@pytest.mark.parametrize("compiled", [False, True], ids=["rebuilt", "op-level"])
def test_selective_recompute_keeps_the_cuda_attention_kernels_outputs(compiled):
    """Both mechanisms (rebuilt cheap steps in eager blocks; op-level checkpointing, which compiled
    blocks run, here eager): backward reruns no matmul and no attention kernel on CUDA either."""
    from test_recompute import LAYERS, OpCounts, config, model_for

    from llmforge.parallel.recompute import apply_recompute
    from llmforge.train.loss import cross_entropy

    cfg = config(moe=False, flavour="llama")
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), device=CUDA)
    counts = {}
    for mode in ("none", "selective"):
        model = apply_recompute(model_for(cfg).to(CUDA), mode=mode, compiled=compiled)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = cross_entropy(logits, tokens[:, 1:])
        with OpCounts() as ops:
            loss.backward()
        counts[mode] = (ops.matmuls, ops.attention)
    assert counts["selective"] == counts["none"] and counts["none"][1] == 0, (counts, LAYERS)
