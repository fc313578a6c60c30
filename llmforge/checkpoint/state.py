"""What goes into a checkpoint: tensors keyed by parameter name, RNG states, JSON.

Model and optimizer tensors are keyed by fully qualified parameter name
(``model.layers.3.attn.qkv_proj.weight``, ``optim.layers.3.attn.qkv_proj.weight.exp_avg``),
whatever the layout: DTensor shards of tensor parallelism and FSDP, pipeline
chunks holding a subset of the layers, or one plain module. DCP stores each
tensor once with its global shape, so any other layout can read it back.
Optimizer hyper-parameters (lr, betas, weight decay) are not stored: they come
from the (possibly overridden) plan, and the learning rate from the scheduler.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from llmforge.checkpoint import objstore
from llmforge.files import write_json_atomic
from llmforge.parallel.materialize import model_name
from llmforge.storage import is_url, join

RNG_DIR = "rng"


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (a zero-gradient, zero-lr step) so DCP can load into them."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def tensor_state(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer, *, for_load: bool = False) -> dict[str, Any]:
    """``{"model": {fqn: tensor}, "optim": {fqn.state_name: tensor}}`` for this rank.

    The optimizer entries are the optimizer's own state tensors, so a DCP load
    writes into them in place."""
    if for_load:
        _init_optimizer_state(optimizer)
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    for part in model_parts:
        model_state.update(get_model_state_dict(part))
        for name, param in part.named_parameters():
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    optim_state[f"{model_name(name)}.{key}"] = value
    return {"model": model_state, "optim": optim_state}


def apply_model_state(model_parts: list[nn.Module], model_state: dict[str, Any], *, full: bool = False) -> None:
    """Copy loaded model tensors into each part (each takes the names it holds).

    ``full``: the tensors are whole (not this layout's shards); each is sharded
    like the parameter it loads into."""
    for part in model_parts:
        own = get_model_state_dict(part)
        set_model_state_dict(part, {k: model_state[k] for k in own}, options=StateDictOptions(strict=True, full_state_dict=full))


def save_rng(folder: Any, *, rank: int) -> None:
    """Write this rank's RNG states (CPU, and CUDA when present) as JSON (``folder``: a path or an object-storage URL)."""
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    if is_url(folder):
        objstore.write_json(join(folder, RNG_DIR, _rng_name(rank)), state)
        return
    out = folder / RNG_DIR
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / _rng_name(rank), state, durable=True)


def _rng_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def saved_world_size(folder: Any) -> int:
    """How many ranks wrote RNG states into a checkpoint."""
    if is_url(folder):
        return sum(1 for rel in objstore.objects(folder) if rel.startswith(f"{RNG_DIR}/rank_") and rel.endswith(".json"))
    return len(list((folder / RNG_DIR).glob("rank_*.json")))


def load_rng(folder: Any, *, rank: int, world_size: int) -> bool:
    """Restore this rank's RNG states if the checkpoint was written by as many ranks.

    Returns False (states untouched) when the layout changed: the streams of
    another world size have no meaningful per-rank mapping."""
    if saved_world_size(folder) != world_size:
        return False
    if is_url(folder):
        data = objstore.read_json(join(folder, RNG_DIR, _rng_name(rank)))
    else:
        data = json.loads((folder / RNG_DIR / _rng_name(rank)).read_text())
    torch.set_rng_state(_bytes_tensor(data["torch"]))
    if "cuda" in data and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(data["cuda"]))
    return True


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
