"""model.init_from: training starts from a Hugging Face folder made offline by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmforge.checkpoint import store
from llmforge.checkpoint.export import export_checkpoint
from llmforge.checkpoint.hf_import import check_folder, load_hf_weights
from llmforge.cli import app
from llmforge.config.schema import ModelConfig, RunConfig
from llmforge.errors import UserError
from llmforge.models.gpt import GPT
from llmforge.observe.metrics import read_metrics
from llmforge.plan import RunPlan
from llmforge.train.optim import build_optimizer

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

runner = CliRunner()

#: A tiny GPT-2 with the vocabulary of the shared test corpus; its position table is
#: longer than the training sequence (the run uses the first seq_len rows).
GPT2_KEYS = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=128",
    "model.seq_len=32",
]
LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    vocab_size=96,
    seq_len=16,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
    norm_eps=1e-6,
    rope_theta=500000.0,
)
GPT2 = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=128, vocab_size=96, seq_len=16)


def save_hf(folder: Path, config) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and biases start at 1/0: move them so every tensor is checked
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


def hf_gpt2(folder: Path, *, vocab: int, positions: int) -> Path:
    return save_hf(
        folder,
        transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    )


def hf_llama(folder: Path) -> Path:
    return save_hf(
        folder,
        transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            rms_norm_eps=1e-6,
            rope_theta=500000.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
    )


def hf_loss(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return logits, float(loss)


def checkpoint(tmp: Path, model: GPT) -> Path:
    plan = RunPlan.build(RunConfig(model=model.config))
    saver = store.CheckpointSaver(root=tmp / "checkpoints", keep=1, async_save=False, rank=0, log=lambda t: None)
    return saver.save(
        step=1, model_parts=[model], optimizer=build_optimizer(model, optim=plan.config.optim, lr=1e-3), train_state={}, plan=plan.to_dict()
    )


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_logits_match_and_export_import_export_is_bit_exact(tmp_path, style):
    cfg = LLAMA if style == "llama" else GPT2
    folder = hf_llama(tmp_path / "hf") if style == "llama" else hf_gpt2(tmp_path / "hf", vocab=96, positions=24)
    model = GPT(cfg)
    load_hf_weights([model], folder=folder, model=cfg)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    theirs, their_loss = hf_loss(folder, tokens)
    with torch.no_grad():
        ours = model(tokens[:, :-1])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert abs(float(torch.nn.functional.cross_entropy(ours.flatten(0, 1), tokens[:, 1:].flatten())) - their_loss) < 1e-5

    first = export_checkpoint(checkpoint(tmp_path / "a", model), model=cfg, out_dir=tmp_path / "export1")[0].parent
    again = GPT(cfg)
    load_hf_weights([again], folder=first, model=cfg)
    second = export_checkpoint(checkpoint(tmp_path / "b", again), model=cfg, out_dir=tmp_path / "export2")[0].parent
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    original, exported = load_file(folder / "model.safetensors"), load_file(first / "model.safetensors")
    for name, tensor in exported.items():
        expected = original[name][: tensor.shape[0]] if name == "transformer.wpe.weight" else original[name]
        assert torch.equal(tensor, expected), name


def test_a_folder_of_another_shape_is_refused_with_every_difference(tmp_path):
    folder = hf_llama(tmp_path / "hf")
    wrong = ModelConfig(**{**LLAMA.__dict__, "hidden_size": 64, "num_layers": 3})
    with pytest.raises(UserError) as info:
        check_folder(folder, wrong)
    text = info.value.message()
    assert "model.hidden_size = 64: config.json has 32. Fix: set model.hidden_size=32" in text
    assert "model.num_layers = 3" in text
    assert "model.layers.0.self_attn.q_proj.weight: shape [32, 32]" in text and "needs [64, 64]" in text
    assert "... and 10 more tensors" in text
    with pytest.raises(UserError, match="model.layers.2.self_attn.q_proj.weight: missing from the folder; this model needs shape"):
        check_folder(folder, ModelConfig(**{**LLAMA.__dict__, "num_layers": 3}))
    with pytest.raises(UserError, match="model_type"):
        check_folder(folder, GPT2)
    with pytest.raises(UserError, match="no such folder"):
        check_folder(tmp_path / "nowhere", LLAMA)


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory, small_data):
    """The same 1-step run from one tiny GPT-2 folder in one process and under tp2."""
    tmp = tmp_path_factory.mktemp("init")
    folder = hf_gpt2(tmp / "hf", vocab=4096, positions=64)
    base = [
        "pretrain",
        *small_data,
        f"model.init_from={folder}",
        *GPT2_KEYS,
        "train.steps=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "logging.console=false",
        "logging.wandb.mode=disabled",
        "checkpoint.save_final=false",
    ]
    results = {}
    for name, extra in (("single", []), ("tp2", ["parallel=tp2"])):
        result = runner.invoke(app, [*base, f"run.dir={tmp / name}", *extra])
        assert result.exit_code == 0, result.output
        results[name] = read_metrics(tmp / name / "metrics.jsonl")[0]["loss"]
    return folder, base, results, tmp


def test_the_first_loss_is_transformers_loss_on_the_same_batch(gpt2_runs):
    from rich.console import Console

    from llmforge.config.compose import compose
    from llmforge.train.run import make_sampler, prepare_data

    folder, base, results, _ = gpt2_runs
    plan = RunPlan.build(compose(base[1:]))
    batch = make_sampler(plan, prepare_data(plan, console=Console(stderr=True))).next_batch(dp_rank=0, dp_size=1)
    _, theirs = hf_loss(folder, batch)
    assert abs(results["single"] - theirs) < 1e-5
    assert abs(results["tp2"] - results["single"]) < 1e-5


def test_a_mismatched_folder_ends_the_command_with_exit_2(gpt2_runs):
    folder, base, _, tmp = gpt2_runs
    result = runner.invoke(app, [*base, "model.hidden_size=64", f"run.dir={tmp / 'bad'}"])
    assert result.exit_code == 2
    assert "model.hidden_size = 64: config.json has 32" in result.output and "transformer.wte.weight: shape [4096, 32]" in result.output
    assert "Traceback" not in result.output and not (tmp / "bad" / "metrics.jsonl").exists()
