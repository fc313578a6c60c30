"""CPU offload on a GPU: offloaded states in pinned host memory, the optimizer stepping them
there, saved activations copied to pinned host memory (less device memory), and the same
losses as training on the device; through torchrun with one rank (FSDP2 over a mesh of one,
NCCL, the collective guard: the host-side norm must go over its gloo group).

    python -m pytest -m gpu tests/gpu/test_offload_gpu.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from gpu_support import DEVICES, LOW_PRECISION_REL, accelerator, child_env

from llmforge.testing.harness import tiny_plan, train_layout

pytestmark = pytest.mark.gpu

LAYOUTS = {
    "zero3_offload": ["parallel.zero=3", "parallel.offload=states"],
    "zero1_offload_activations": ["parallel.zero=1", "parallel.offload=states", "parallel.offload_activations=true"],
    "activations": ["parallel.offload_activations=true"],
    "bf16_zero3_offload": ["parallel.zero=3", "parallel.offload=states", "precision.param_dtype=bf16"],
}


@pytest.fixture(scope="module", params=DEVICES)
def offloaded(request, tmp_path_factory):
    device = request.param
    tmp = tmp_path_factory.mktemp(f"offload-{device}")
    spec, out = tmp / "spec.json", tmp / "out.pt"
    spec.write_text(
        json.dumps({"base": [f"cluster.accelerator={accelerator(device)}"], "layouts": LAYOUTS, "device": device, "mesh_of_one": True})
    )
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


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offloaded_training_matches_training_on_the_device(offloaded, name):
    device, results = offloaded
    got = results[name]
    precision = [o for o in LAYOUTS[name] if o.startswith("precision.")]
    ref = train_layout(tiny_plan([f"cluster.accelerator={accelerator(device)}", *precision]), device=torch.device(device))
    tolerance = LOW_PRECISION_REL if precision else (1e-5 if device == "cpu" else 1e-4)
    assert len(got["losses"]) == 5
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref.losses, strict=False)) < tolerance


@pytest.fixture
def one_rank_group(free_port):
    import torch.distributed as dist

    from llmforge.parallel.mesh import backend_for

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{free_port}", world_size=1, rank=0)
    yield device
    dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_states_live_pinned_on_the_host(device, one_rank_group):
    from llmforge.parallel.dtensor import local
    from llmforge.testing.harness import SyntheticSampler, rank_info
    from llmforge.train.build import build_components

    plan = tiny_plan([f"cluster.accelerator={accelerator(device)}", "parallel.zero=3", "parallel.offload=states"])
    sampler = SyntheticSampler(vocab_size=256, seq_len=32, global_batch_size=8, seed=0)
    c = build_components(plan, rank=rank_info(plan, device=one_rank_group, mesh_of_one=True), sampler=sampler)
    out = c.step(sampler.next_batch(dp_rank=0, dp_size=1))
    norm = c.clip_grads(1.0)
    c.optimizer.step()
    params = [p for part in c.model_parts for p in part.parameters()]
    assert all(local(p).device.type == "cpu" for p in params)
    assert all(local(s).device.type == "cpu" for st in c.optimizer.state.values() for s in st.values() if torch.is_tensor(s) and s.dim())
    assert out.loss.device == norm.device == one_rank_group  # what the loop reads stays on the compute device
    if one_rank_group.type == "cuda":
        assert all(local(p).is_pinned() for p in params)
        assert all(c.optimizer.defaults.get("fused") or g.get("fused") for g in c.optimizer.param_groups)


@pytest.mark.parametrize("device", DEVICES)
def test_saved_activations_go_to_pinned_host_memory(device):
    from llmforge.models.gpt import GPT
    from llmforge.parallel.offload import ActivationOffload

    dev = torch.device(device)
    plan = tiny_plan(["model.hidden_size=256", "model.ffn_hidden_size=1024", "model.seq_len=256"])
    model = GPT(plan.config.model)
    model.init_weights(seed=0)
    model.to(dev)
    tokens = torch.randint(0, 256, (4, 257), device=dev)
    offload = ActivationOffload(dev)
    packed = []
    pack = offload.pack
    offload.pack = lambda t: packed.append(pack(t)) or packed[-1]  # type: ignore[method-assign]

    def peak(offloaded: bool) -> int:
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with offload.active() if offloaded else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(tokens[:, :-1]).float().logsumexp(-1).mean()
        loss.backward()
        return torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0

    plain, moved = peak(False), peak(True)
    hosted = [p[1] for p in packed if isinstance(p, tuple)]
    assert hosted and all(h.device.type == "cpu" for h in hosted)
    if dev.type == "cuda":
        assert all(h.is_pinned() for h in hosted)
        assert moved < plain
