"""A checkpoint's model with torchao-quantized linear layers (``llmforge export --quantize``).

The blocks' linear layers are quantized with the torchao config of a QAT scheme
(``llmforge.parallel.qat``): for a run trained with ``precision.qat`` this is the
conversion QAT prepared for, and it computes what the fake-quantized model computed; for
any other run it is post-training quantization with the same numbers.

Two files go next to the Hugging Face export:

- ``quantized.safetensors``: the whole model's state dict, the quantized weights
  flattened into plain tensors (int8 values holding the int4 levels, scales, zero points)
  by torchao's safetensors support, so loading unpickles nothing;
- ``quantization.json``: the scheme, the group size, the quantized layers, the torchao
  version and the model's shape (``model.*`` keys).

``load_quantized(folder)`` rebuilds the llmforge model from them (torch, torchao and
llmforge installed; CPU or GPU): ``model(tokens)`` returns the logits (docs/qat.md).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from torch import nn

from llmforge.config.schema import ModelConfig
from llmforge.errors import Problem, UserError
from llmforge.models.gpt import GPT
from llmforge.parallel.float8 import quiet_torchao
from llmforge.parallel.qat import quantize

QUANTIZED_FILE = "quantized.safetensors"
QUANTIZATION_FILE = "quantization.json"
FORMAT = "llmforge-torchao-1"


def quantized_model(weights: dict[str, torch.Tensor], *, model: ModelConfig, scheme: str, group_size: int) -> tuple[nn.Module, list[str]]:
    """The whole model with ``weights`` (a checkpoint's, by parameter name) and its blocks'
    linear layers quantized; and the names of those layers."""
    if model.tie_embeddings:
        weights = {k: v for k, v in weights.items() if k != "head.weight"}  # the last pipeline stage's copy of the embedding
    net = GPT(model)
    net.load_state_dict(weights, strict=True)
    net.requires_grad_(False).eval()
    return net, quantize(net, scheme=scheme, group_size=group_size)


def write_quantized(net: nn.Module, *, model: ModelConfig, scheme: str, group_size: int, layers: list[str], folder: Path) -> list[str]:
    """Write ``quantized.safetensors`` and ``quantization.json`` into ``folder``; returns their names."""
    from safetensors.torch import save_file

    with quiet_torchao():
        import torchao
        from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    tensors, metadata = flatten_tensor_state_dict(net.state_dict())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / QUANTIZED_FILE), metadata=metadata)
    info = {
        "format": FORMAT,
        "scheme": scheme,
        "group_size": group_size,
        "quantized_layers": layers,
        "torchao_version": torchao.__version__,
        "model": dataclasses.asdict(model),
    }
    (folder / QUANTIZATION_FILE).write_text(json.dumps(info, indent=2) + "\n")
    shutil.copymode(
        folder / QUANTIZATION_FILE, folder / QUANTIZED_FILE
    )  # safetensors creates its file 0600; the others get the umask's mode
    return [QUANTIZED_FILE, QUANTIZATION_FILE]


def load_quantized(folder: str | Path, *, device: str | torch.device = "cpu") -> nn.Module:
    """The quantized model an export wrote into ``folder``, in eval mode on ``device``:
    ``model(token_ids)`` ([batch, seq] int64) returns logits [batch, seq, vocab]."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    folder = Path(folder)
    info = _read_info(folder)
    with quiet_torchao():
        from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict
    with safe_open(str(folder / QUANTIZED_FILE), "pt") as f:
        metadata = f.metadata()
    state, leftover = unflatten_tensor_state_dict(load_file(str(folder / QUANTIZED_FILE)), metadata)
    if leftover and set(leftover) - set(state):
        raise _damaged(folder, f"tensors that belong to no weight: {sorted(set(leftover) - set(state))[:3]}")
    net = GPT(_model_config(info["model"]))
    net.requires_grad_(False)
    net.load_state_dict(state, strict=True, assign=True)
    return net.eval().to(device)


def _read_info(folder: Path) -> dict:
    try:
        info = json.loads((folder / QUANTIZATION_FILE).read_text())
    except FileNotFoundError:
        raise UserError(
            [
                Problem(
                    "folder",
                    str(folder),
                    f"has no {QUANTIZATION_FILE}: it is not a quantized export",
                    "export one with llmforge export ckpt=PATH --out DIR --quantize int8-int4",
                )
            ],
            title="not a quantized model",
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise _damaged(folder, str(exc)) from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not isinstance(info.get("model"), dict):
        raise _damaged(folder, f"{QUANTIZATION_FILE} is not in the {FORMAT} format")
    return info


def _model_config(data: dict) -> ModelConfig:
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), data))  # type: ignore[return-value]


def _damaged(folder: Path, why: str) -> UserError:
    return UserError(
        [Problem("folder", str(folder), f"the quantized export is damaged ({why})", "export it again with llmforge export")],
        title="damaged export",
    )
