"""Save and load training state with torch.distributed.checkpoint (DCP).

A checkpoint is a folder ``checkpoints/step_N/`` holding the sharded model and
optimizer state (DCP's own format: every layout can read it back and reshard it
by parameter name) and ``train_state.json`` (step, scheduler, sampler, loss
scaler). It is written into ``.tmp-step_N`` and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from llmforge.errors import fail

TRAIN_STATE = "train_state.json"


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def tensor_state(model_parts: List[nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """Model and optimizer state keyed by fully qualified parameter names."""
    model_state: Dict[str, Any] = {}
    optim_state: Dict[str, Any] = {}
    for part in model_parts:
        m, o = get_state_dict(part, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
        model_state.update(m)
        optim_state.update({k: v for k, v in o.items() if k.split(".", 1)[0] in ("state", "param_groups") and _owned(k, m)})
    return {"model": model_state, "optim": optim_state}


def _owned(key: str, model_state: Dict[str, Any]) -> bool:
    # flattened keys look like "state.<fqn>.exp_avg" or "param_groups.<fqn>.lr"
    fqn = key.split(".", 1)[1].rsplit(".", 1)[0]
    return fqn in model_state


def save(*, root: Path, step: int, model_parts: List[nn.Module], optimizer: torch.optim.Optimizer, train_state: Dict[str, Any]) -> Path:
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(tensor_state(model_parts, optimizer), checkpoint_id=str(tmp))
    _barrier()
    if _is_main():
        (tmp / TRAIN_STATE).write_text(json.dumps({"step": step, **train_state}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def load(*, path: Path, model_parts: List[nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """Restore model and optimizer in place (resharding as needed); return the train state."""
    state_file = path / TRAIN_STATE
    if not state_file.is_file():
        raise fail(f"{path}: not a complete checkpoint ({TRAIN_STATE} is missing)")
    state = tensor_state(model_parts, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    for part in model_parts:
        set_state_dict(
            part,
            optimizer,
            model_state_dict={k: v for k, v in state["model"].items()},
            optim_state_dict=state["optim"],
            options=StateDictOptions(flatten_optimizer_state_dict=True, strict=False),
        )
    return json.loads(state_file.read_text())
