"""FP8 on a GPU with FP8 tensor cores (H100, H200, B200): torchao's float8 matmuls, not
emulated, compiled, through torchrun with one rank so FSDP2 all-gathers float8 weights
over NCCL and the scales are precomputed after each optimizer step. The losses follow
the bf16 run of the same plan. Without a GPU the same checks run emulated on CPU (eager)."""

from __future__ import annotations

import pytest
import torch
from gpu_support import DEVICES, accelerator, llmforge, losses

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao")

SHAPE = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=1024",
    "model.vocab_size=4096",
    "model.seq_len=256",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.steps=20",
    "train.log_interval=1",
    "train.lr=1e-3",  # at 2e-3 the step after warmup sits at the edge of stability, and rounding decides a spike
    "optim.warmup_steps=5",
    "checkpoint.save_final=false",
    "logging.console=false",
    "logging.wandb.mode=disabled",
    "precision.fp8_linears=all",  # a numerics test: at width 256 no linear is large enough for float8 to pay
]
#: fp8 against bf16 on the same plan after a few steps: the float8 casts add rounding
FP8_REL = 3e-2


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(scope="module", params=DEVICES)
def pair(request, tmp_path_factory, small_data):
    device = request.param
    if device == "cuda" and not _fp8_capable():
        pytest.skip("this GPU has no FP8 tensor cores")
    tmp = tmp_path_factory.mktemp(f"fp8-{device}")
    base = [*SHAPE, *small_data, f"cluster.accelerator={accelerator(device)}", "cluster.launcher=torchrun", "parallel.zero=3"]
    if device == "cuda":  # compiled, as fp8 is meant to run
        bf16, fp8 = ["precision=bf16", "train.compile=true"], ["precision=fp8", "train.compile=true", "--force"]  # slower at this width
    else:
        bf16, fp8 = ["precision=bf16"], ["precision=fp8", "precision.fp8_emulate=true"]
    llmforge(["pretrain", *base, *bf16, f"run.dir={tmp / 'bf16'}"], timeout=600)
    llmforge(["pretrain", *base, *fp8, f"run.dir={tmp / 'fp8'}"], timeout=600)
    return device, losses(tmp / "bf16"), losses(tmp / "fp8")


def test_fp8_trains_like_bf16(pair):
    _, bf16, fp8 = pair
    steps = sorted(bf16)
    assert sorted(fp8) == steps == list(range(1, 21))
    assert fp8[20] < fp8[1] - 0.5  # it learns
    worst = max(steps, key=lambda s: abs(fp8[s] - bf16[s]) / bf16[s])
    assert abs(fp8[worst] - bf16[worst]) <= FP8_REL * bf16[worst], f"step {worst}: fp8 {fp8[worst]:.4f}, bf16 {bf16[worst]:.4f}"


def test_fp8_layers_are_float8_on_the_device(pair):
    """The converted model runs real float8 matmuls (not emulated) on the GPU."""
    device, _, _ = pair
    if device != "cuda":
        pytest.skip("emulated on CPU")
    from llmforge.testing.harness import tiny_plan
    from llmforge.train.build import build_model
    from llmforge.train.parallelize import parallelize

    plan = tiny_plan(["precision.fp8=true", "precision.param_dtype=bf16", "cluster.accelerator=h100-80gb"])
    model = build_model(plan, device=torch.device("cuda"))
    parallelize(model, plan=plan, mesh=None)
    linear = model.layers["0"].attn.qkv_proj
    assert type(linear).__name__ == "Float8Linear" and not linear.config.emulate
    x = torch.randn(2, 32, 32, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = linear(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


def test_bench_fp8_rows_run_on_the_gpu(small_data):
    """tools/bench_fp8.py's rows (what the GPU benchmark prints) on a small model."""
    if not _fp8_capable():
        pytest.skip("needs a GPU with FP8 tensor cores")
    import importlib.util

    from gpu_support import REPO

    spec = importlib.util.spec_from_file_location("bench_fp8", REPO / "tools" / "bench_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = [*bench.BASE, *SHAPE, *small_data, "train.global_batch_size=4"]
    rows = bench.precision_rows(small, steps=6, warmup=2, recipes=("tensorwise", "rowwise"), compile=False)
    assert list(rows) == ["bf16", "fp8 tensorwise", "fp8 rowwise"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["peak_gib"] > 0 and row["loss"] < 8.4 and row["estimate_tokens_per_s"] > 0
    assert rows["fp8 tensorwise"]["ratio"] > 0
