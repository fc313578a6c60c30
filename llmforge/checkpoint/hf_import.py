"""``model.init_from=DIR``: start training from a Hugging Face GPT-2 or Llama folder.

The folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Before launch, :func:`check_folder` compares
it with the composed model: config.json's shape and flavour against the
``model.*`` keys, then every tensor name and shape against what this model
needs (names from ``llmforge.checkpoint.hf_names``, read backwards). All
differences are reported at once.

On each rank, :func:`load_hf_weights` reads only the tensors its model parts hold
(safetensors are memory-mapped), one at a time, renames/splits each into its
llmforge name and keeps only this rank's slice of it, in whatever layout the parts
have (tensor parallel, FSDP, pipeline chunks; ``llmforge.parallel.materialize``):
a rank holds its shards and one whole tensor, never the whole state dict.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmforge.checkpoint.hf_names import from_hf, style_of, to_hf
from llmforge.config.schema import ModelConfig
from llmforge.errors import Problem, UserError, fail
from llmforge.models.gpt import GPT
from llmforge.parallel.materialize import fill

KEY = "model.init_from"
#: Tensors some Hugging Face checkpoints carry that are not weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
_WPE = "transformer.wpe.weight"
_SHOWN = 20


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise UserError(
            [
                Problem(
                    KEY,
                    str(folder),
                    "is a file, not a folder" if folder.exists() else "no such folder",
                    "point it at a folder holding config.json and model.safetensors",
                )
            ],
            title="cannot start from these weights",
        )
    try:
        data = json.loads((folder / "config.json").read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as exc:
        raise UserError(
            [
                Problem(
                    KEY,
                    str(folder),
                    f"config.json is missing or unreadable ({exc})",
                    "save the model with save_pretrained(), which writes config.json",
                )
            ],
            title="cannot start from these weights",
        ) from None


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise fail(f"{index}: unreadable ({exc})", title="cannot start from these weights") from None
    single = folder / "model.safetensors"
    if not single.is_file():
        raise UserError(
            [
                Problem(
                    KEY,
                    str(folder),
                    "holds no model.safetensors (nor model.safetensors.index.json)",
                    "save the model with save_pretrained(safe_serialization=True)",
                )
            ],
            title="cannot start from these weights",
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


@contextlib.contextmanager
def open_tensors(folder: Path) -> Iterator[tuple[dict[str, list[int]], Callable[[str], torch.Tensor]]]:
    """(shape of every tensor, a getter that reads one tensor) for the folder."""
    from safetensors import safe_open

    files = _tensor_files(folder)
    with contextlib.ExitStack() as stack:
        try:
            handles = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in set(files.values())}
        except Exception as exc:  # safetensors raises its own error types for damaged headers
            raise fail(f"{folder}: cannot read the safetensors files ({exc})", title="cannot start from these weights") from None
        shapes = {name: list(handles[path].get_slice(name).get_shape()) for name, path in files.items()}
        yield shapes, lambda name: handles[files[name]].get_tensor(name)


def config_problems(hf: dict[str, Any], m: ModelConfig, *, style: str) -> list[Problem]:
    """Each ``model.*`` key whose value differs from what config.json describes."""
    kind = hf.get("model_type")
    if kind != style:
        fix = {
            "llama": "for a Llama folder use model.norm=rmsnorm model.activation=swiglu model.position=rope model.bias=false",
            "gpt2": "for a GPT-2 folder use model.norm=layernorm model.activation=gelu model.position=learned model.bias=true",
        }
        return [
            Problem(
                "config.json model_type", kind, f"the composed model is {style}-style", fix.get(kind, "start from a GPT-2 or Llama folder")
            )
        ]
    implied, semantic = (_llama_view if style == "llama" else _gpt2_view)(hf)
    problems = [
        Problem(key, _value(m, key), f"config.json has {value!r}", f"set {key}={value}")
        for key, value in implied.items()
        if value is not None and _value(m, key) != value
    ]
    if style == "gpt2" and hf.get("n_positions", m.seq_len) < m.seq_len:
        problems.append(
            Problem(
                "model.seq_len",
                m.seq_len,
                f"the folder's position table has {hf['n_positions']} rows",
                f"set model.seq_len to at most {hf['n_positions']}",
            )
        )
    problems += [Problem(KEY, f"config.json {name}={value!r}", why, "start from a model without it") for name, value, why in semantic]
    return problems


def _value(m: ModelConfig, key: str) -> Any:
    if key == "model.num_kv_heads":
        return m.num_kv_heads or m.num_heads
    return getattr(m, key.split(".", 1)[1])


def _llama_view(hf: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any, str]]]:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    heads = hf.get("num_attention_heads")
    implied = {
        "model.hidden_size": hf.get("hidden_size"),
        "model.num_layers": hf.get("num_hidden_layers"),
        "model.num_heads": heads,
        "model.num_kv_heads": hf.get("num_key_value_heads", heads),
        "model.ffn_hidden_size": hf.get("intermediate_size"),
        "model.vocab_size": hf.get("vocab_size"),
        "model.norm_eps": hf.get("rms_norm_eps"),
        "model.rope_theta": float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "model.bias": bool(hf.get("attention_bias", False)),
    }
    semantic = []
    if hf.get("hidden_act", "silu") != "silu":
        semantic.append(("hidden_act", hf["hidden_act"], "llmforge's swiglu uses silu"))
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        semantic.append(("rope_type", rope.get("rope_type", rope.get("type")), "llmforge has plain RoPE only"))
    if hf.get("mlp_bias", False) != hf.get("attention_bias", False):
        semantic.append(("mlp_bias", hf.get("mlp_bias"), "model.bias sets attention and MLP biases together"))
    if heads and hf.get("head_dim") not in (None, hf.get("hidden_size", 0) // heads):
        semantic.append(("head_dim", hf["head_dim"], "llmforge's head size is hidden_size / num_heads"))
    return implied, semantic


def _gpt2_view(hf: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any, str]]]:
    width = hf.get("n_embd")
    implied = {
        "model.hidden_size": width,
        "model.num_layers": hf.get("n_layer"),
        "model.num_heads": hf.get("n_head"),
        "model.ffn_hidden_size": hf.get("n_inner") or (4 * width if width else None),
        "model.vocab_size": hf.get("vocab_size"),
        "model.norm_eps": hf.get("layer_norm_epsilon"),
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }
    semantic = []
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        semantic.append(("activation_function", hf["activation_function"], "llmforge's gelu is the tanh approximation (gelu_new)"))
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            semantic.append((flag, True, "llmforge's attention has no such variant"))
    if hf.get("scale_attn_weights") is False:
        semantic.append(("scale_attn_weights", False, "llmforge always scales attention by 1/sqrt(head size)"))
    return implied, semantic


def expected_shapes(m: ModelConfig) -> dict[str, list[int]]:
    """Hugging Face tensor name -> the shape this model needs (no memory allocated)."""
    with torch.device("meta"):
        weights = GPT(m).state_dict()
    return {name: list(t.shape) for name, t in to_hf(weights, m).items()}


def tensor_problems(found: dict[str, list[int]], m: ModelConfig) -> list[Problem]:
    """Missing, mis-shaped and unexpected tensors, in the model's order (a longer GPT-2
    position table is fine: the run uses its first ``seq_len`` rows)."""
    problems, needed = [], expected_shapes(m)
    for name, shape in needed.items():
        have = found.get(name)
        if have is None:
            problems.append(
                Problem(name, "", f"missing from the folder; this model needs shape {shape}", "start from a folder of this model's shape")
            )
        elif have != shape and not (name == _WPE and have[0] >= shape[0] and have[1:] == shape[1:]):
            problems.append(
                Problem(
                    name, "", f"shape {have} in the folder, this model needs {shape}", "set the model.* keys to the folder's config.json"
                )
            )
    for name, shape in found.items():
        if name not in needed and not name.endswith(_IGNORED_SUFFIXES) and not (name == "lm_head.weight" and m.tie_embeddings):
            problems.append(
                Problem(
                    name, "", f"shape {shape} in the folder, and this model has no such tensor", "start from a folder of this model's shape"
                )
            )
    if len(problems) > _SHOWN:
        problems = problems[:_SHOWN] + [Problem("", "", f"... and {len(problems) - _SHOWN} more tensors", "")]
    return problems


def check_folder(folder: Path | str, m: ModelConfig) -> list[str]:
    """Raise one UserError listing every difference between the folder and the model;
    return notes worth showing (a tokenizer in the folder, a shortened position table)."""
    folder = Path(folder).expanduser()
    config = _read_config(folder)
    try:
        style = style_of(m)
    except UserError as exc:
        raise UserError(exc.problems, title=f"{KEY} needs a GPT-2 or Llama-style model") from None
    problems = config_problems(config, m, style=style)
    with open_tensors(folder) as (shapes, _):
        if config.get("model_type") == style:
            problems += tensor_problems(shapes, m)
    if problems:
        raise UserError(problems, title=f"{folder} does not fit this model")
    notes = []
    if style == "gpt2" and shapes[_WPE][0] > m.seq_len:
        notes.append(
            f"{KEY}: using the first {m.seq_len} of the folder's {shapes[_WPE][0]} position embeddings (model.seq_len={m.seq_len})"
        )
    if (folder / "tokenizer.json").is_file():
        notes.append(f"{KEY}: the folder has a tokenizer; train with it with data.tokenizer={folder / 'tokenizer.json'}")
    return notes


def load_hf_weights(model_parts: list[nn.Module], *, folder: Path | str, model: ModelConfig) -> None:
    """Replace the parts' weights with the folder's, in whatever layout the parts have:
    one tensor is read at a time and only this rank's slice of it is kept."""
    check_folder(folder, model)
    folder = Path(folder).expanduser()
    with open_tensors(folder) as (_, get):

        def read(name: str) -> torch.Tensor:
            tensor = get(name)
            return tensor[: model.seq_len] if name == _WPE else tensor

        def whole(name: str, shape: torch.Size) -> torch.Tensor:
            found = from_hf(read, model, wanted=[name])
            if name not in found:
                raise fail(f"{folder}: nothing maps to {name}", title="cannot start from these weights")
            return found[name]

        for part in model_parts:
            fill(part, values=whole)
