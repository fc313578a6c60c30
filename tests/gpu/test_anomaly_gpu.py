"""Non-finite steps on a GPU: fused AdamW skips them on the device (found_inf) with no host
read, in one process and through torchrun, NCCL and a device mesh as multi-GPU runs do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from gpu_support import DEVICES, accelerator, child_env
from test_anomaly import assert_same_params, drills, fused_skip_without_a_read

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_nan_step_costs_no_host_read_on_a_gpu():
    fused_skip_without_a_read(torch.device("cuda", 0))


@pytest.mark.parametrize("device", DEVICES)
def test_one_rank_through_torchrun_skips_rolls_back_and_stops(tmp_path, device):
    layouts = {
        name: {**spec, "overrides": [f"cluster.accelerator={accelerator(device)}", *spec["overrides"]], "mesh_of_one": True}
        for name, spec in drills([], rank="0", kind="nan-grad", folder=tmp_path).items()
    }
    spec_file, out = tmp_path / "spec.json", tmp_path / "out.pt"
    spec_file.write_text(json.dumps({"layouts": layouts, "device": device}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "llmforge.testing.drill",
        str(spec_file),
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = torch.load(out, weights_only=False)
    rtol = 1e-5 if device == "cpu" else 1e-4  # GPU kernels are not bit-deterministic
    assert_same_params(runs["skip"]["params"], runs["skip_ref"]["params"], rtol=rtol)
    assert_same_params(runs["rollback"]["params"], runs["rollback_ref"]["params"], rtol=rtol)
    assert "stopped at step 4: at step 4 the gradient norm was nan" in runs["stop"]["error"]
    assert sorted(p.name for p in (tmp_path / "stop").iterdir()) == ["step_2"]
