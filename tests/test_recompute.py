"""Activation recomputation: same gradients, fewer bytes kept for backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from llmforge.config.schema import ModelConfig, MoEConfig
from llmforge.estimate.activations import layer_bytes
from llmforge.estimate.shape import Job, shape_from_config
from llmforge.hardware import get_profile
from llmforge.layout import Layout
from llmforge.models.gpt import GPT
from llmforge.models.moe import moe_layers, moe_metrics
from llmforge.parallel.recompute import CheckpointedModule, RebuiltModule, apply_recompute
from llmforge.parallel.residual import apply_residual_dtype
from llmforge.train.step import cross_entropy

BATCH, SEQ, LAYERS = 4, 16, 4


def config(*, moe: bool, flavour: str, dropout: float = 0.0) -> ModelConfig:
    llama = flavour == "llama"
    experts = MoEConfig(
        num_experts=4, top_k=2, ffn_hidden_size=32, num_shared_experts=1, capacity_factor=1.25 if not llama else None, z_loss_coef=1e-3
    )
    return ModelConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2 if llama else None,
        ffn_hidden_size=64,
        vocab_size=96,
        seq_len=SEQ,
        norm="rmsnorm" if llama else "layernorm",
        activation="swiglu" if llama else "gelu",
        position="rope" if llama else "learned",
        bias=not llama,
        dropout=dropout,
        moe=experts if moe else MoEConfig(num_experts=0),
    )


def model_for(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    model.init_weights(seed=3)
    return model


class LiveStorages(TorchDispatchMode):
    """Records every storage an op creates; ``alive_bytes`` sums those still held."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs[(storage.data_ptr(), storage.nbytes())] = StorageWeakRef(storage)
        return out

    def alive_bytes(self, *, exclude: set) -> int:
        return sum(n for (ptr, n), ref in self.refs.items() if not ref.expired() and ptr not in exclude)


def block_stack(model: GPT, x: torch.Tensor) -> torch.Tensor:
    rope = (model.rope_cos, model.rope_sin) if model.rope_cos is not None else None
    for layer in model.layers.values():
        x = layer(x, rope)
    return x


def kept_bytes(model: GPT, x: torch.Tensor) -> int:
    """Bytes the transformer blocks keep alive for backward: what ops created and
    still hold after forward (weights and the stack's output excluded) plus the
    stack's input. Checkpointing hides its tensors from outer saved-tensor hooks,
    so storages are tracked at the dispatcher instead."""
    own = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    live = LiveStorages()
    with live:
        out = block_stack(model, x)
    stats = {
        t.untyped_storage().data_ptr()
        for _, layer in moe_layers([model])
        for t in vars(layer.stats).values()
        if isinstance(t, torch.Tensor)
    }
    kept = live.alive_bytes(exclude=own | stats | {out.untyped_storage().data_ptr()}) + x.untyped_storage().nbytes()
    out.sum().backward()
    return kept


def hooked_bytes(model: GPT, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward, seen through saved_tensors_hooks (weights excluded)."""
    own = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block_stack(model, x)
    out.sum().backward()
    return sum(seen.values())


def estimated_bytes(cfg: ModelConfig, *, mode: str, every: int = 1) -> float:
    job = Job(global_batch=BATCH, param_dtype="fp32", reduce_dtype="fp32", profile=get_profile("cpu"))
    layout = Layout(recompute=mode, recompute_every=every, micro_batch_size=BATCH)
    return sum(layer_bytes(shape_from_config(cfg), layout, job, i) for i in range(cfg.num_layers))


def grads_after_backward(model: GPT, tokens: torch.Tensor, *, bf16: bool = False) -> dict:
    torch.manual_seed(5)  # dropout masks
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens[:, :-1])
    cross_entropy(logits, tokens[:, 1:]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_recompute_gives_the_same_gradients(moe: bool, flavour: str) -> None:
    """Every mode, and selective recompute by both mechanisms: rebuilt cheap steps (eager) and
    op-level checkpointing (what compiled blocks run, here eager)."""
    cfg = config(moe=moe, flavour=flavour, dropout=0.1)
    base = model_for(cfg)
    tokens = torch.randint(0, 96, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    expected = grads_after_backward(copy.deepcopy(base), tokens)
    for mode, every, compiled in (("selective", 1, False), ("selective", 1, True), ("full", 1, False), ("full", 2, False)):
        model = apply_recompute(copy.deepcopy(base), mode=mode, every=every, compiled=compiled)
        got = grads_after_backward(model, tokens)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=f"{mode}/{every}/{compiled}: {name}")


@pytest.mark.parametrize("residual", ["bf16", "fp32"])
@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_rebuilt_steps_give_the_same_bf16_gradients_without_a_dispatch_mode(flavour: str, residual: str, monkeypatch) -> None:
    """Under autocast the rebuilt norms (and, with an fp32 residual stream, autocast's casts of their
    outputs), RoPE, repeat and activation run as in forward: the same bits as without recompute, and
    fewer bytes kept; no op passes through op-level checkpointing's dispatch mode."""
    from torch.utils import checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("an eager dense block ran op-level selective checkpointing")

    monkeypatch.setattr(checkpoint._CachingTorchDispatchMode, "__torch_dispatch__", refuse)
    base = model_for(config(moe=False, flavour=flavour))
    if residual == "bf16":  # the default: the norms' outputs feed the linears as they are
        apply_residual_dtype(base, dtype=torch.bfloat16)
    tokens = torch.randint(0, 96, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    expected = grads_after_backward(copy.deepcopy(base), tokens, bf16=True)
    model = apply_recompute(copy.deepcopy(base), mode="selective")
    assert all(isinstance(b, RebuiltModule) for b in model.layers.values())
    got = grads_after_backward(model, tokens, bf16=True)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    dtype = torch.bfloat16 if residual == "bf16" else torch.float32
    x = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(1), dtype=dtype, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = {mode: kept_bytes(apply_recompute(copy.deepcopy(base), mode=mode), x) for mode in ("none", "selective")}
    assert kept["selective"] < 0.85 * kept["none"], kept


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_saved_bytes_fall_per_mode_as_estimated(moe: bool, flavour: str) -> None:
    cfg = config(moe=moe, flavour=flavour)
    base = model_for(cfg)
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert kept_bytes(copy.deepcopy(base), x) == hooked_bytes(copy.deepcopy(base), x)  # the two measures agree
    measured = {}
    for mode, every in (("none", 1), ("selective", 1), ("full", 2), ("full", 1)):
        measured[mode, every] = kept_bytes(apply_recompute(copy.deepcopy(base), mode=mode, every=every), x)
        estimate = estimated_bytes(cfg, mode=mode, every=every)
        tolerance = 0.10
        assert abs(measured[mode, every] / estimate - 1) <= tolerance, (mode, every, measured[mode, every], estimate)
    assert measured["none", 1] > measured["selective", 1] > measured["full", 1], measured
    assert measured["none", 1] > measured["full", 2] > measured["full", 1], measured
    assert measured["full", 1] == LAYERS * BATCH * SEQ * cfg.hidden_size * 4  # each block's input only


def test_full_every_n_checkpoints_the_same_layers_on_a_pipeline_stage() -> None:
    model = model_for(config(moe=True, flavour="gpt"))
    for name in ("0", "1"):  # a second pipeline stage holds layers 2 and 3 only
        del model.layers[name]
    apply_recompute(model, mode="full", every=2)
    assert {n: isinstance(b, CheckpointedModule) for n, b in model.layers.items()} == {"2": True, "3": False}
    assert [n for n, _ in model.named_parameters()][:1] == ["embed.weight"]  # names unchanged
    assert any(n.startswith("layers.2.mlp.experts.w_up") for n, _ in model.named_parameters())


def test_moe_statistics_are_not_counted_again_by_recomputation() -> None:
    cfg = config(moe=True, flavour="gpt")
    tokens = torch.randint(0, 96, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    plain, full = model_for(cfg), apply_recompute(model_for(cfg), mode="full")
    grads_after_backward(plain, tokens)
    grads_after_backward(full, tokens)
    assert all(layer.mlp.stats.forwards == 1 for layer in full.layers.values())
    assert moe_metrics([full]) == moe_metrics([plain])


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="recompute mode"):
        apply_recompute(model_for(config(moe=False, flavour="gpt")), mode="everything", every=1)


class OpCounts(TorchDispatchMode):
    """How often matmuls and fused attention ran while the mode was active."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            self.matmuls += 1
        elif name.startswith("_scaled_dot_product") and "backward" not in name:
            self.attention += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("flavour", ["gpt", "llama"])
def test_selective_recompute_reruns_no_matmul_and_no_attention(flavour: str) -> None:
    """Backward under selective runs the matmuls that backward without recompute runs,
    and no attention forward; full recompute reruns both."""
    cfg = config(moe=False, flavour=flavour)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    counts = {}
    for mode in ("none", "selective", "full"):
        model = apply_recompute(model_for(cfg), mode=mode)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        with OpCounts() as ops:
            loss.backward()
        counts[mode] = (ops.matmuls, ops.attention)
    assert counts["selective"] == counts["none"] and counts["none"][1] == 0
    assert counts["full"][0] > counts["none"][0] and counts["full"][1] == LAYERS
