"""A forward with no backward (validation) leaves ZeRO 1/2 modules and ZeRO 3's root and last block on
their gathered weights; a checkpoint must check and save the sharded ones (under fp8
all-gather the gathered weights are float8 tensors that support almost no op)."""

from __future__ import annotations

import types

import pytest
import torch
from tiny_models import GPT_TINY
from torch.distributed.tensor import DTensor

from llmforge.models.gpt import GPT
from llmforge.parallel.data import apply_fsdp
from llmforge.train.recovery import check_and_save


def _validated(mesh, *, zero: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPT_TINY)
    apply_fsdp(model, dp_mesh=mesh, zero=zero, param_dtype=torch.float32, reduce_dtype=torch.float32)
    with torch.no_grad():
        model(torch.zeros(1, GPT_TINY.seq_len, dtype=torch.long))
    return model


class _Saver:
    def __init__(self) -> None:
        self.saved_sharded: bool | None = None

    def save(self, *, model_parts, **_) -> None:
        self.saved_sharded = all(isinstance(p, DTensor) for part in model_parts for p in part.parameters())


@pytest.mark.parametrize("zero", [2, 3])
def test_a_checkpoint_after_validation_checks_and_saves_the_sharded_parameters(one_rank, zero):
    model = _validated(one_rank, zero=zero)
    assert not all(isinstance(p, DTensor) for p in model.parameters()), "validation left no module gathered: the test sees nothing"
    saver = _Saver()
    components = types.SimpleNamespace(
        model_parts=[model],
        parameters=lambda: list(model.parameters()),
        guard=types.SimpleNamespace(protected=lambda: None),
        rank=types.SimpleNamespace(mesh=one_rank, device=torch.device("cpu")),
        optimizer=None,
    )
    check_and_save(components, saver, step=1, train_state={}, plan={})
    assert saver.saved_sharded is True


def test_zero3_keeps_the_root_and_the_last_block_gathered_after_forward_and_reshards_the_others(one_rank):
    """Backward starts with the output layer (the root's) and the last block: gathering them again
    there would cost one more all-gather each per microbatch."""
    model = _validated(one_rank, zero=3)
    root = {name: p for name, p in model.named_parameters() if not name.startswith("layers.")}
    assert root and not any(isinstance(p, DTensor) for p in root.values()), sorted(root)
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers.values()):
        assert all(isinstance(p, DTensor) for p in block.parameters()) == (index != last), index
