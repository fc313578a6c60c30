"""``llmforge estimate --measure``: run the real model on CPU and measure what the estimate predicts.

The estimator (``llmforge.estimate``) is arithmetic only; this runs the model
it describes. It measures, for one process and one microbatch of the plan's model:

- parameters (every tensor of ``GPT``, built on the meta device);
- bytes saved for backward, through ``torch.autograd.graph.saved_tensors_hooks``
  (parameters and buffers excluded, each storage counted once);
- forward and backward FLOPs with ``FlopCounterMode`` (with the CPU fused
  attention kernels mapped to the formulas torch uses for the CUDA ones).

Small models run for real. Larger ones run on fake CPU tensors (shapes, dtypes
and kernel choice as on CPU, no arithmetic) and, past a few blocks, on copies
with fewer layers whose per-block figures are scaled to the full depth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import llmforge.parallel.recompute as recompute
from llmforge.config.choices import Dtype, Recompute
from llmforge.estimate import activations as act
from llmforge.estimate import flops as fl
from llmforge.estimate.params import total_params
from llmforge.estimate.shape import Job, shape_from_config
from llmforge.layout import Layout
from llmforge.models.gpt import GPT
from llmforge.parallel.recompute import apply_recompute, checkpoint_module, rebuild_module, rebuilds, selective_policy
from llmforge.parallel.residual import apply_residual_dtype
from llmforge.train.loss import cross_entropy
from llmforge.train.precision import DTYPES, residual_dtype

REAL_LIMIT = 3e10  # parameters x tokens per microbatch beyond which fake tensors are used


def cpu_flop_mapping() -> dict:
    """FLOP formulas for the CPU fused-attention kernels and the experts' grouped matmuls,
    which FlopCounterMode does not list."""
    aten = torch.ops.aten
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
    }
    if hasattr(aten, "_grouped_mm"):
        mapping[aten._grouped_mm] = _grouped_mm_flops
    return mapping


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Each row of ``a`` meets one group's matrix: 2 x rows x inner x columns. Two 2-D operands
    (the weights' gradient) split their inner dimension into the groups instead."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


@dataclass
class Measurement:
    """What one forward and backward of one microbatch did."""

    saved_bytes: int
    forward_flops: int
    backward_flops: int


def _recompute_wrap(model, *, mode: str, every: int) -> list:
    """Apply llmforge's recompute to the blocks; returns the list that will collect the
    op-level selective-checkpoint caches (matmul outputs kept outside autograd's saved tensors);
    a block that rebuilds its cheap steps shows what it keeps to the outer saved-tensor hooks."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    caches: list = []
    if mode != Recompute.SELECTIVE:
        apply_recompute(model, mode=mode, every=every)
        return caches

    def context():
        forward, recompute = create_selective_checkpoint_contexts(selective_policy)
        caches.append(forward.storage)
        return forward, recompute

    for block in model.layers.values():
        if rebuilds(block, compiled=False):
            rebuild_module(block)
        else:
            checkpoint_module(block, context=context)
    return caches


@contextlib.contextmanager
def selective_caches() -> Iterator[list]:
    """While active, every selective-recompute region the backend opens
    (``llmforge.parallel.recompute.selective_context``) adds its cache of kept outputs
    to the list this yields (they are saved outside autograd's saved tensors)."""
    caches: list = []
    original = recompute.selective_context

    def context():
        forward, again = original()
        caches.append(forward.storage)
        return forward, again

    recompute.selective_context = context
    try:
        yield caches
    finally:
        recompute.selective_context = original


def cached_tensors(caches: list) -> Iterator[torch.Tensor]:
    """The tensors held in selective-recompute caches (see ``selective_caches``)."""
    for storage in caches:
        for outputs in storage.values():
            for item in outputs.values() if isinstance(outputs, dict) else outputs:
                for wrapped in item if isinstance(item, (tuple, list)) else (item,):
                    value = getattr(wrapped, "val", None)
                    if isinstance(value, torch.Tensor):
                        yield value


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def run_once(model, *, micro_batch: int, param_dtype: str, vocab: int, seq: int, caches: list = ()) -> Measurement:
    """Forward + loss (llmforge's) + backward of one microbatch, counting saved bytes and FLOPs."""
    excluded = {_storage_key(p) for p in model.parameters()} | {_storage_key(b) for b in model.buffers()}
    saved: dict[int, int] = {}

    def pack(t):
        key = _storage_key(t)
        if key not in excluded:
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
        return t

    tokens = torch.randint(0, vocab, (micro_batch, seq + 1))
    cast = torch.autocast("cpu", dtype=DTYPES[param_dtype]) if param_dtype != Dtype.FP32 else contextlib.nullcontext()
    counter = FlopCounterMode(display=False, custom_mapping=cpu_flop_mapping())
    with counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with cast:
                logits = model(tokens[:, :-1])
            loss = cross_entropy(logits, tokens[:, 1:])
        for t in cached_tensors(caches):
            pack(t)
        forward = counter.get_total_flops()
        loss.backward()
    return Measurement(saved_bytes=sum(saved.values()), forward_flops=forward, backward_flops=counter.get_total_flops() - forward)


def measure_config(
    model_cfg,
    *,
    micro_batch: int,
    param_dtype: str,
    recompute: Recompute = Recompute.NONE,
    every: int = 1,
    fake: bool | None = None,
    fp32_residual: bool = False,
) -> Measurement:
    """Build ``GPT(model_cfg)`` and measure one microbatch (real or fake CPU tensors), with
    the residual stream in the dtype a run keeps it in."""
    if fake is None:
        fake = total_params(shape_from_config(model_cfg)) * micro_batch * model_cfg.seq_len > REAL_LIMIT
    mode = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    with mode:
        torch.manual_seed(0)
        model = GPT(model_cfg)
        model.train()
        if param_dtype != Dtype.FP32:
            apply_residual_dtype(model, dtype=residual_dtype(param_dtype=param_dtype, fp32_residual=fp32_residual))
        caches = _recompute_wrap(model, mode=recompute, every=every)
        return run_once(
            model, micro_batch=micro_batch, param_dtype=param_dtype, vocab=model_cfg.vocab_size, seq=model_cfg.seq_len, caches=caches
        )


def count_parameters(model_cfg) -> dict[str, tuple]:
    """``{name: shape}`` of the real model, built on the meta device."""
    with torch.device("meta"):
        model = GPT(model_cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@dataclass
class Row:
    name: str
    estimate: float
    measured: float | None


@dataclass
class MeasuredReport:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"rows": [dataclasses.asdict(r) for r in self.rows], "notes": list(self.notes)}


def _scaled(
    model_cfg, *, micro_batch: int, param_dtype: str, recompute: str, every: int, fp32_residual: bool = False
) -> tuple[Measurement, str]:
    """Measure the full depth directly, or two shallow copies and extrapolate per block group."""
    group = max(model_cfg.moe.every, every)
    small = total_params(shape_from_config(model_cfg)) * micro_batch * model_cfg.seq_len <= REAL_LIMIT
    if small or model_cfg.num_layers <= 2 * group:
        m = measure_config(
            model_cfg, micro_batch=micro_batch, param_dtype=param_dtype, recompute=recompute, every=every, fp32_residual=fp32_residual
        )
        return m, f"all {model_cfg.num_layers} blocks measured"
    kw = dict(micro_batch=micro_batch, param_dtype=param_dtype, recompute=recompute, every=every, fp32_residual=fp32_residual)
    one = measure_config(dataclasses.replace(model_cfg, num_layers=group), **kw)
    two = measure_config(dataclasses.replace(model_cfg, num_layers=2 * group), **kw)
    reps = model_cfg.num_layers // group - 1

    def scale(a: int, b: int) -> int:
        return a + reps * (b - a)

    m = Measurement(
        scale(one.saved_bytes, two.saved_bytes), scale(one.forward_flops, two.forward_flops), scale(one.backward_flops, two.backward_flops)
    )
    return m, f"measured on copies with {group} and {2 * group} blocks, scaled to {model_cfg.num_layers}"


def single_process_estimate(shape, job: Job, *, micro_batch: int, recompute: str, every: int) -> dict:
    """The estimator's figures for one process running one microbatch (what ``measure`` sees)."""
    layout = Layout(micro_batch_size=micro_batch, recompute=recompute, recompute_every=every)
    tokens = micro_batch * shape.seq
    saved = sum(act.layer_bytes(shape, layout, job, i) for i in range(shape.num_layers))
    saved += act.embedding_bytes(shape, layout) + act.output_bytes(shape, layout, job)
    extra = sum(fl.recompute_flops_per_token(shape, layout, i) for i in range(shape.num_layers)) * tokens
    return {
        "params": total_params(shape),
        "saved_bytes": saved,
        "forward_flops": fl.forward_flops(shape, tokens),
        "backward_flops": fl.backward_flops(shape, tokens) + extra,
    }


def measure_plan(plan, est) -> MeasuredReport:
    """Estimate and measurement side by side for the plan's model, one process, one microbatch."""
    cfg = plan.config
    p = plan.layout
    mb = plan.layout.micro_batch_size
    names = count_parameters(cfg.model)
    measured_params = sum(_numel(s) for s in names.values())
    m, how = _scaled(
        cfg.model,
        micro_batch=mb,
        param_dtype=cfg.precision.param_dtype,
        recompute=p.recompute,
        every=p.recompute_every,
        fp32_residual=cfg.precision.fp32_residual,
    )
    eager = dataclasses.replace(est.job, compile=False)  # the measurement runs eager blocks
    ref = single_process_estimate(est.shape, eager, micro_batch=mb, recompute=p.recompute, every=p.recompute_every)
    report = MeasuredReport(
        rows=[
            Row("parameters", ref["params"], measured_params),
            Row(f"bytes saved for backward (1 microbatch of {mb}, recompute={p.recompute})", ref["saved_bytes"], m.saved_bytes),
            Row("forward FLOPs (1 microbatch)", ref["forward_flops"], m.forward_flops),
            Row("backward FLOPs (1 microbatch, with recompute)", ref["backward_flops"], m.backward_flops),
        ]
    )
    fake = total_params(est.shape) * mb * cfg.model.seq_len > REAL_LIMIT
    report.notes.append("parameters counted on the full model built on the meta device")
    report.notes.append(
        ("fake CPU tensors (no arithmetic; shapes, dtypes and kernels as on CPU); " if fake else "real CPU tensors; ") + how
    )
    report.notes.append("one process, one microbatch: the per-rank figures above split these same tensors by the layout")
    if cfg.model.moe.num_experts:
        report.notes.append(
            "MoE: the estimate assumes balanced routing; the measured run routes with the freshly initialised router, whose "
            "uneven loads pad every expert's batch to the busiest expert's (more FLOPs and bytes). Under balanced routing "
            "the two agree exactly (tests/test_estimate_model.py)."
        )
    return report


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
