"""A checkpoint's model in Hugging Face format (``llmforge export``).

Writes ``model.safetensors`` and ``config.json`` that ``transformers`` loads as
``LlamaForCausalLM`` for Llama-style models (rmsnorm, swiglu, rope; GQA and
biases allowed; ``MinistralForCausalLM`` with sliding-window layers) or ``GPT2LMHeadModel`` for GPT-style models (layernorm, gelu,
learned positions, biases, no GQA); the names follow ``llmforge.checkpoint.hf_names``.

With the run's tokenizer (from the prepared-data cache) it also writes
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, so
``AutoTokenizer`` and ``AutoModelForCausalLM`` load the folder as a whole.

Weights are read straight from the DCP shards (no model is built, nothing is
unpickled) in the dtype they were saved in (fp32 master weights).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from rich.console import Console

from llmforge.checkpoint.export_folder import swap_in, temporary_beside
from llmforge.checkpoint.hf_names import style_of, to_hf
from llmforge.checkpoint.quantized import quantized_model, write_quantized
from llmforge.checkpoint.safe_reader import load_metadata, safe_reader
from llmforge.checkpoint.store import quiet_single_process
from llmforge.config.schema import ModelConfig, RunConfig
from llmforge.data.prepare import prepare
from llmforge.errors import Problem, UserError
from llmforge.files import write_json_atomic
from llmforge.models.fused import fuse_saved
from llmforge.models.masks import windowed_layer

__all__ = ["check_exportable", "export_checkpoint", "hf_config", "read_model_weights", "run_tokenizer_file", "style_of"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a checkpoint, unsharded, keyed by parameter name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = load_metadata(path)
    weights = {
        key[len("model.") :]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    with quiet_single_process():
        dcp.load({"model": weights}, storage_reader=safe_reader(path), no_dist=True)
    return weights


def hf_config(m: ModelConfig, *, style: str, dtype: torch.dtype, eos_id: int | None = None) -> dict:
    """config.json for the exported model."""
    common = {
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"),
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
    }
    if style == "llama":
        llama = {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": m.hidden_size,
            "intermediate_size": m.ffn_hidden_size,
            "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads or m.num_heads,
            "head_dim": m.hidden_size // m.num_heads,
            "max_position_embeddings": m.seq_len,
            "rms_norm_eps": m.norm_eps,
            "hidden_act": "silu",
            "rope_theta": m.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "attention_bias": m.bias,
            "mlp_bias": m.bias,
            "attention_dropout": m.dropout,
        }
        return llama if m.sliding_window <= 0 else {**llama, **_windowed(m)}
    return {
        **common,
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_heads,
        "n_inner": m.ffn_hidden_size,
        "n_positions": m.seq_len,
        "n_ctx": m.seq_len,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m.norm_eps,
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout,
        "scale_attn_weights": True,
    }


def _windowed(m: ModelConfig) -> dict:
    """A Llama with sliding-window layers is a Ministral (per-layer ``layer_types``; same weight names)."""
    kinds = ["sliding_attention" if windowed_layer(m, i) else "full_attention" for i in range(m.num_layers)]
    return {"architectures": ["MinistralForCausalLM"], "model_type": "ministral", "sliding_window": m.sliding_window, "layer_types": kinds}


def check_exportable(m: ModelConfig) -> None:
    """Refuse what the exported architecture cannot express (the style itself: ``style_of``).
    Document masks and position reset need nothing at inference (one document)."""
    if m.sliding_window <= 0:
        return
    if style_of(m) == "gpt2":
        raise UserError(
            [
                Problem(
                    "model.sliding_window",
                    m.sliding_window,
                    "GPT-2 has no sliding-window attention",
                    "export a Llama-style model (rmsnorm, swiglu, rope) for sliding windows",
                )
            ],
            title="no Hugging Face format for this model",
        )
    if m.bias:
        raise UserError(
            [
                Problem(
                    "model.bias",
                    m.bias,
                    "Hugging Face's sliding-window Llama (Ministral) has no biases",
                    "train with model.bias=false to export sliding windows",
                )
            ],
            title="no Hugging Face format for this model",
        )


def tokenizer_files(tokenizer: Path, *, eos_id: int, seq_len: int) -> dict[str, object]:
    """tokenizer.json plus the small files ``AutoTokenizer`` needs to load it as a
    ``PreTrainedTokenizerFast`` (the end-of-document token is bos, eos and pad)."""
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(tokenizer)).id_to_token(eos_id)
    special = {"bos_token": eos, "eos_token": eos, "pad_token": eos}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len, "clean_up_tokenization_spaces": False, **special}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "special_tokens_map.json": special}


def export_checkpoint(
    path: Path, *, model: ModelConfig, out_dir: Path, tokenizer: tuple[Path, int] | None = None, quantize: tuple[str, int] | None = None
) -> list[Path]:
    """Write model.safetensors and config.json for the checkpoint at ``path`` into
    ``out_dir``, and the tokenizer files when ``tokenizer`` (tokenizer.json, end-of-document id) is given;
    with ``quantize`` (QAT scheme, group size) also the torchao-quantized model (``llmforge.checkpoint.quantized``).

    Files are written into a temporary folder next to ``out_dir``, which replaces
    ``out_dir`` whole only when complete (``llmforge.checkpoint.export_folder``)."""
    from safetensors.torch import save_file

    style = style_of(model)
    weights = fuse_saved(read_model_weights(path), model)  # checkpoints of unfused models too
    tensors = to_hf(weights, model)
    dtype = next(iter(weights.values())).dtype
    out_dir = Path(os.path.realpath(out_dir))  # a link to a folder: replace the folder it names, not the link
    tmp = temporary_beside(out_dir)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json_atomic(
            tmp / "config.json", hf_config(model, style=style, dtype=dtype, eos_id=tokenizer[1] if tokenizer else None), durable=True
        )
        shutil.copymode(
            tmp / "config.json", tmp / "model.safetensors"
        )  # safetensors creates its file 0600; the others get the umask's mode
        extra = tokenizer_files(tokenizer[0], eos_id=tokenizer[1], seq_len=model.seq_len) if tokenizer else {}
        for name, content in extra.items():
            if isinstance(content, Path):
                shutil.copyfile(content, tmp / name)
            else:
                write_json_atomic(tmp / name, content, durable=True)
        quantized = _write_quantized(weights, model=model, quantize=quantize, folder=tmp) if quantize else []
        swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out_dir / name for name in ("model.safetensors", "config.json", *extra, *quantized)]


def _write_quantized(weights: dict[str, torch.Tensor], *, model: ModelConfig, quantize: tuple[str, int], folder: Path) -> list[str]:

    scheme, group_size = quantize
    net, layers = quantized_model(dict(weights), model=model, scheme=scheme, group_size=group_size)
    return write_quantized(net, model=model, scheme=scheme, group_size=group_size, layers=layers, folder=folder)


def run_tokenizer_file(config: RunConfig, *, console: Console | None) -> tuple[Path, int]:
    """The tokenizer.json a run trained with and its end-of-document id, from the
    prepared-data cache (prepared again, identically, if the cache was removed)."""
    vocab = config.data.vocab_size or config.model.vocab_size
    prepared = prepare(data=config.data, vocab_size=vocab, seed=config.train.seed, console=console)
    return prepared.tokenizer_path, prepared.eos_id
