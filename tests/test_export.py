"""Export to Hugging Face format: same logits as llmforge's model, checked with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmforge.checkpoint import store
from llmforge.checkpoint.export import style_of
from llmforge.commands.checkpoint import export_command
from llmforge.config.schema import ModelConfig, RunConfig
from llmforge.errors import UserError
from llmforge.models.gpt import GPT
from llmforge.plan import RunPlan
from llmforge.train.optim import build_optimizer

transformers = pytest.importorskip("transformers")

GPT_STYLE = dict(norm="layernorm", activation="gelu", position="learned", bias=True, num_kv_heads=4, tie_embeddings=True)
LLAMA_STYLE = dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False, num_kv_heads=2, tie_embeddings=False)


def checkpoint_of(tmp_path: Path, **flavour) -> tuple[GPT, Path]:
    """A saved checkpoint of a tiny model whose weights are all non-trivial."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=48, vocab_size=96, seq_len=16, **flavour)
    model = GPT(cfg)
    model.init_weights(seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # init makes these 0/1; move them off
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    plan = RunPlan.build(RunConfig(model=cfg))
    saver = store.CheckpointSaver(root=tmp_path / "run" / "checkpoints", keep=1, async_save=False, rank=0, log=lambda t: None)
    optimizer = build_optimizer(model, optim=plan.config.optim, lr=1e-3)
    path = saver.save(step=1, model_parts=[model], optimizer=optimizer, train_state={}, plan=plan.to_dict())
    return model, path


# sliding windows of 5 on layers 0 (of 2), document masks and position reset (nothing at inference)
WINDOWED = dict(LLAMA_STYLE, sliding_window=5, sliding_window_every=2, attention_mask="document", position_reset=True)


@pytest.mark.parametrize(
    "flavour,architecture", [(GPT_STYLE, "GPT2LMHeadModel"), (LLAMA_STYLE, "LlamaForCausalLM"), (WINDOWED, "MinistralForCausalLM")]
)
def test_exported_model_gives_the_same_logits(tmp_path, flavour, architecture):
    from rich.console import Console

    model, path = checkpoint_of(tmp_path, **flavour)
    out = tmp_path / "hf"
    export_command([f"ckpt={tmp_path / 'run'}"], out_dir=out, console=Console(stderr=True))
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, torch_dtype=torch.float32)
    assert type(hf).__name__ == architecture
    hf.eval()
    model.eval()
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
    assert ours.abs().max() > 0.1  # the comparison is not between near-zero tensors
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


def test_unsupported_flavour_and_extra_overrides_are_refused(tmp_path):
    with pytest.raises(UserError, match="matches neither Llama nor GPT-2"):
        style_of(ModelConfig(norm="rmsnorm", activation="gelu", position="learned"))
    _, path = checkpoint_of(tmp_path, **GPT_STYLE)
    with pytest.raises(UserError, match="export takes no overrides"):
        export_command([f"ckpt={path}", "train.steps=3"], out_dir=tmp_path / "x", console=None)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()
    _, path = checkpoint_of(tmp_path / "w", **dict(GPT_STYLE, sliding_window=4))
    with pytest.raises(UserError, match="GPT-2 has no sliding-window attention"):
        export_command([f"ckpt={path}"], out_dir=tmp_path / "y", console=None)  # type: ignore[arg-type]
    assert not (tmp_path / "y").exists()
