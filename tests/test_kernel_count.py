"""The estimator's kernel counts held to the tiny model's train step, profiled on CPU.

What counts as a kernel in the profile (``torch.profiler``, CPU activity): the outermost aten
op on each call path that launches work. View and alias ops (their schema returns an alias of
an input), allocations (``empty``...) and no-ops (``dropout`` at p=0) launch none, so the
count looks through them to the ops they call (a ``reshape`` that has to copy counts its
``clone``). A composite op counts once however it runs inside (``linear``, ``layer_norm``,
``scaled_dot_product_attention``): one kernel on a GPU. Ops run by an autograd node are
backward kernels, the rest forward ones.

The estimator counts kernels as a GPU runs them eagerly (``llmforge.blockspec.costs``); three
ops run differently on a CPU, and the test maps them to their GPU counts:

- ``native_layer_norm_backward``: one CPU op, two GPU kernels (input gradient; weight and bias gradients);
- RMSNorm: on a CPU ``F.rms_norm`` is decomposed (pow, mean, rsqrt, products) and autograd runs
  each piece backward; on a GPU it is one fused kernel whose backward is two, as LayerNorm's. The
  profiled model runs its RMSNorms as LayerNorms without bias (the same kernels a GPU runs);
- flash attention's backward: one CPU op, three GPU kernels.

Under autocast (bf16 here) ``linear`` (and ``bmm``) casts its input and its weights inside the op;
a GPU runs each cast as a kernel of its own, so those casts count one each (the estimator's weight
casts forward, and their gradients' back, are ``llmforge.estimate.kernels._weights_cost``'s). A
CPU's ``add`` of an fp32 and a bf16 tensor copies one of them first, which a GPU's kernel does not.
The mixed-precision step keeps the residual stream in fp32 (``precision.fp32_residual``), as the
estimator's memory-bound model assumes.

A block's kernels are those of a model with two blocks less those of a model with one (the
embedding, the output layer and the loss cancel).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from tiny_models import GPT_TINY, LLAMA_TINY  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from llmforge.blockspec import costs  # noqa: E402
from llmforge.config.schema import ModelConfig, MoEConfig  # noqa: E402
from llmforge.estimate import kernels as kn  # noqa: E402
from llmforge.estimate.shape import shape_from_config  # noqa: E402
from llmforge.models.gpt import GPT  # noqa: E402
from llmforge.train.loss import cross_entropy  # noqa: E402

CONFIGS = {
    "gpt": GPT_TINY,
    "llama": LLAMA_TINY,
    "llama-mha-bias": dataclasses.replace(LLAMA_TINY, num_kv_heads=None, bias=True),
    "gelu-rope-gqa": dataclasses.replace(GPT_TINY, position="rope", bias=False, num_kv_heads=2),
    "moe": dataclasses.replace(LLAMA_TINY, moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=48, num_shared_experts=1, every=2)),
    "moe-gelu-capacity": dataclasses.replace(GPT_TINY, moe=MoEConfig(num_experts=4, top_k=1, ffn_hidden_size=64, capacity_factor=2.0)),
}
BATCH = 2
NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::result_type",
    "aten::_unsafe_view",
    "aten::dropout",
    "aten::lift_fresh",
    "aten::detach",
}
#: CPU op -> its kernels on a GPU, where they differ.
GPU_KERNELS = {"aten::native_layer_norm_backward": 2, "aten::_scaled_dot_product_flash_attention_for_cpu_backward": 3}
_ALIAS: dict[str, bool] = {}


def _is_alias(name: str) -> bool:
    """Whether the aten op returns a view of its input (any overload)."""
    if name not in _ALIAS:
        packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
        returns = []
        for overload in packet.overloads() if packet is not None else ():
            try:
                returns.append(getattr(packet, overload)._schema.returns)
            except (AttributeError, RuntimeError):
                continue
        _ALIAS[name] = any(r and r[0].alias_info is not None and not r[0].alias_info.is_write for r in returns)
    return _ALIAS[name]


def _launches(event) -> bool:
    return event.name.startswith("aten::") and event.name not in NO_KERNEL and not _is_alias(event.name)


def _outermost(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _launches(parent):
            return False
        parent = parent.cpu_parent
    return True


def _ancestor(event, prefix: str):
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(prefix):
        parent = parent.cpu_parent
    return parent


#: The ops autocast runs in the compute dtype whose casts the model meets (``linear``; ``bmm``: the experts).
AUTOCAST_OPS = ("aten::linear", "aten::bmm")


def _autocast_cast(event) -> bool:
    return event.name == "aten::_to_copy" and any(_ancestor(event, op) is not None for op in AUTOCAST_OPS)


def count_kernels(events) -> tuple[int, int]:
    """(forward, backward) kernels of a profiled step, as a GPU runs them (module docstring)."""
    counts: Counter[str] = Counter()
    for e in events:
        if _launches(e) and (_outermost(e) or _autocast_cast(e)):
            backward = _ancestor(e, "autograd::engine::evaluate_function") is not None
            counts["bwd" if backward else "fwd"] += GPU_KERNELS.get(e.name, 1)
    return counts["fwd"], counts["bwd"]


def profiled_step(cfg: ModelConfig, *, mixed: bool) -> tuple[int, int]:
    """Kernels of one forward, loss and backward of ``GPT(cfg)`` (gradients unset before, as at a
    step's first microbatch); ``mixed``: the forward under bf16 autocast."""
    torch.manual_seed(0)
    model = GPT(cfg)
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            logits = model(tokens[:, :-1])
        cross_entropy(logits, tokens[:, 1:]).backward()

    step()  # the first call of some ops does one-time work
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return count_kernels(prof.events())


def profiled_block(cfg: ModelConfig, *, mixed: bool) -> tuple[int, int]:
    """Kernels of the model's second block: two blocks less one."""
    two = profiled_step(dataclasses.replace(cfg, num_layers=2), mixed=mixed)
    one = profiled_step(dataclasses.replace(cfg, num_layers=1), mixed=mixed)
    return two[0] - one[0], two[1] - one[1]


def estimated_block(cfg: ModelConfig, *, mixed: bool) -> tuple[int, int]:
    """The estimator's kernels of block 1 (one rank): matmuls (backward: the input's and the
    weight's gradient each), fused attention, the description's memory-bound ops, and under
    autocast each linear weight's cast and its gradient's back."""
    shape = shape_from_config(cfg)
    k = kn.block_kernels(shape, t=BATCH * cfg.seq_len, tp=1, sp=1, ep=1, c=2 if mixed else 4, mixed=mixed, moe=shape.is_moe_layer(1))
    attention_fwd, attention_bwd = costs.ATTENTION_KERNELS
    casts = len(k.weights) if mixed else 0
    return len(k.gemms) + attention_fwd + k.fwd_kernels + casts, 2 * len(k.gemms) + attention_bwd + k.bwd_kernels + casts


def _rms_norm_as_a_gpu_runs_it(x, normalized_shape, weight=None, eps=None):
    return F.layer_norm(x, normalized_shape, weight, None, 1e-5 if eps is None else eps)


@pytest.fixture
def fused_rms_norm(monkeypatch):
    monkeypatch.setattr(F, "rms_norm", _rms_norm_as_a_gpu_runs_it)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_estimator_counts_the_kernels_of_a_block(name, fused_rms_norm):
    cfg = CONFIGS[name]
    assert estimated_block(cfg, mixed=False) == profiled_block(cfg, mixed=False)


@pytest.mark.parametrize("name", ["gpt", "llama", "llama-mha-bias", "moe", "moe-gelu-capacity"])
def test_the_estimator_counts_the_kernels_of_a_block_under_autocast(name, fused_rms_norm):
    cfg = CONFIGS[name]
    assert estimated_block(cfg, mixed=True) == profiled_block(cfg, mixed=True)


#: The fp32 loss's composite ops as a GPU runs them: log-softmax and NLL; a zeroed gradient and its scatter.
LOSS_GPU_KERNELS = {"aten::cross_entropy_loss": 2, "aten::nll_loss_backward": 2}


def test_the_estimator_counts_the_kernels_of_the_fp32_loss(monkeypatch):
    for name, kernels in LOSS_GPU_KERNELS.items():
        monkeypatch.setitem(GPU_KERNELS, name, kernels)
    tokens, vocab = BATCH * GPT_TINY.seq_len, GPT_TINY.vocab_size
    logits = torch.randn(BATCH, GPT_TINY.seq_len, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (BATCH, GPT_TINY.seq_len))
    seed = torch.ones(())  # the backward's seed is the step's, not the loss's
    cross_entropy(logits, targets).backward(seed)
    logits.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cross_entropy(logits, targets).backward(seed)
    assert kn.loss_kind(tokens=tokens, vocab=vocab, c=4, tp=1) == "plain"
    estimated = kn.loss_cost(kn._COUNTER, tokens=tokens, vocab=vocab, c=4, kind="plain").floor
    assert sum(count_kernels(prof.events())) == estimated == 5


def test_the_estimator_charges_the_loss_each_rank_runs():
    from llmforge.train import loss as loss_module

    assert kn.LOSS_CHUNK_ELEMENTS == loss_module.CHUNK_ELEMENTS
    fits = loss_module.CHUNK_ELEMENTS // 4096
    assert kn.loss_kind(tokens=fits, vocab=4096, c=4, tp=1) == "plain"  # one chunk of fp32 logits: F.cross_entropy
    assert kn.loss_kind(tokens=fits + 1, vocab=4096, c=4, tp=1) == "chunked"
    assert kn.loss_kind(tokens=512, vocab=4096, c=2, tp=1) == "chunked"  # bf16 logits
    assert kn.loss_kind(tokens=512, vocab=2048, c=4, tp=2) == "vocab_parallel"


def test_the_output_stage_charges_the_loss_its_rank_runs(monkeypatch):
    from llmforge.layout import Layout

    kinds: list[str] = []
    real = kn.loss_cost
    monkeypatch.setattr(kn, "loss_cost", lambda sp, **kw: kinds.append(kw["kind"]) or real(sp, **kw))
    shape = shape_from_config(GPT_TINY)
    for tp, c in ((1, 4), (2, 4), (1, 2)):
        layout = Layout(tp=tp, micro_batch_size=BATCH)
        kn.ends_cost(kn._COUNTER, shape, layout, c=c, mixed=c == 2, first=False, last=True, accumulate=0.0)
    assert kinds == ["plain", "vocab_parallel", "chunked"]
