"""Hugging Face weights in, text out and the MoE routing bias on the device: a run
started from a transformers folder through torchrun, generation on the GPU, and
auxiliary-loss-free balancing with its load counts on the device."""

from __future__ import annotations

import pytest
import torch
from gpu_support import DEVICES, accelerator, llmforge, losses

from llmforge.testing.harness import tiny_plan, train_layout

pytestmark = pytest.mark.gpu

GPT2 = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=256",
    "model.seq_len=64",
    "model.vocab_size=512",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.steps=2",
    "train.log_interval=1",
    "precision.param_dtype=fp32",
    "logging.console=false",
    "logging.wandb.mode=disabled",
]
MOE_BIAS = [
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.ffn_hidden_size=48",
    "model.seq_len=16",
    "model.moe.balance=bias",
    "model.moe.bias_update_rate=0.01",
]


@pytest.fixture(scope="module", params=DEVICES)
def from_hf(request, tmp_path_factory, small_data):
    transformers = pytest.importorskip("transformers")
    device = request.param
    tmp = tmp_path_factory.mktemp(f"io-{device}")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp / "hf")
    args = [
        *GPT2,
        *small_data,
        f"model.init_from={tmp / 'hf'}",
        f"cluster.accelerator={accelerator(device)}",
        "cluster.launcher=torchrun",
        f"run.dir={tmp / 'run'}",
    ]
    llmforge(["pretrain", *args])
    return device, tmp, args


def test_a_run_from_hugging_face_weights_starts_at_transformers_loss(from_hf):
    transformers = pytest.importorskip("transformers")
    from rich.console import Console

    from llmforge.config.compose import compose
    from llmforge.plan import RunPlan
    from llmforge.train.run import make_sampler, prepare_data

    _, tmp, args = from_hf
    plan = RunPlan.build(compose(args))
    batch = make_sampler(plan, prepare_data(plan, console=Console(stderr=True))).next_batch(dp_rank=0, dp_size=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch[:, :-1]).logits
    theirs = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
    assert abs(losses(tmp / "run")[1] - theirs) < 1e-4 * theirs


def test_greedy_generation_on_the_device_equals_the_cpu(from_hf):
    device, tmp, _ = from_hf
    texts = [
        llmforge(
            [
                "generate",
                f"ckpt={tmp / 'run'}",
                "--prompt",
                "def main(",
                "--device",
                where,
                "generate.temperature=0",
                "generate.max_tokens=12",
            ]
        ).stdout
        for where in (device, "cpu")
    ]
    assert texts[0] == texts[1] and texts[0].startswith("def main(")


@pytest.mark.parametrize("device", DEVICES)
def test_the_routing_bias_moves_the_same_on_the_device(device):
    got = train_layout(tiny_plan(MOE_BIAS), device=torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"))
    ref = train_layout(tiny_plan(MOE_BIAS))
    bias = {k: v for k, v in ref.buffers[0].items() if k.endswith("expert_bias")}
    assert bias and all(v.abs().sum() > 0 for v in bias.values())
    for name, value in bias.items():
        torch.testing.assert_close(got.buffers[0][name], value, rtol=0, atol=1e-6)
    assert max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses, strict=False)) < 1e-4
