"""llmforge <-> Hugging Face parameter names: one table, read in both directions.

Each :class:`Rule` ties one Hugging Face tensor to one or more llmforge tensors.
``export`` reads the table forwards (llmforge -> HF), ``model.init_from`` backwards.

- ``llama`` (``LlamaForCausalLM``): a rename, tensor for tensor, except llmforge's fused
  projections (``llmforge.models.fused``): ``qkv_proj`` holds q_proj, k_proj and v_proj,
  ``gate_up_proj`` holds gate_proj and up_proj, their rows grouped.
- ``gpt2`` (``GPT2LMHeadModel``): q/k/v concatenate into ``c_attn`` along the output
  dimension (from llmforge's grouped ``qkv_proj``), and every linear weight is transposed,
  because GPT-2 uses ``Conv1D`` (``y = x @ W + b``, weight ``[in, out]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from llmforge.config.schema import ModelConfig
from llmforge.errors import Problem, UserError
from llmforge.models.fused import FUSED, fuse, layout_of, unfuse


@dataclass(frozen=True)
class Rule:
    """The Hugging Face tensors ``hf`` and the llmforge tensors ``ours`` hold the same
    parts, rows along dim 0: one tensor per part on a side, or one tensor that is the
    parts concatenated (``sizes``: rows of each part; Hugging Face transposed when
    ``transpose``) or, on ours, fused (``groups``: ``llmforge.models.fused``)."""

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    transpose: bool = False
    sizes: tuple[int, ...] = ()
    groups: int = 0

    def to_hf(self, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        parts = self._split([get(name) for name in self.ours], fused=self.groups > 0)
        if len(self.hf) == 1:
            tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            return {self.hf[0]: tensor.t() if self.transpose else tensor}
        return dict(zip(self.hf, parts, strict=False))

    def from_hf(self, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = [get(name).t() if self.transpose else get(name) for name in self.hf]
        parts = self._split(tensors, fused=False)
        if self.groups:
            return {self.ours[0]: fuse(parts, groups=self.groups)}
        return dict(zip(self.ours, parts, strict=False))

    def _split(self, tensors: list[torch.Tensor], *, fused: bool) -> list[torch.Tensor]:
        """The parts held by ``tensors`` (one side of the rule)."""
        if fused:
            return unfuse(tensors[0], sizes=self.sizes, groups=self.groups)
        if len(tensors) == 1 and len(self.sizes) > 1:
            return list(tensors[0].split(list(self.sizes), dim=0))
        return tensors


def _one(hf: str, ours: str, *, transpose: bool = False) -> Rule:
    return Rule((hf,), (ours,), transpose=transpose)


def _fused(m: ModelConfig, hf: tuple[str, ...], ours: str, *, rows: int, transpose: bool = False) -> Rule:
    """A fused llmforge tensor and its parts, one Hugging Face tensor each or concatenated in one."""
    sizes, groups = layout_of(m, name=ours, rows=rows)
    return Rule(hf, (ours,), transpose=transpose, sizes=tuple(sizes), groups=groups)


def style_of(m: ModelConfig) -> str:
    """``llama`` or ``gpt2``; a UserError listing what matches neither."""
    if m.moe.num_experts > 0:
        raise UserError(
            [Problem("model.moe.num_experts", m.moe.num_experts, "MoE models have no Llama/GPT-2 format", "use a dense model")],
            title="no Hugging Face format for this model",
        )
    llama = {"model.norm": (m.norm, "rmsnorm"), "model.activation": (m.activation, "swiglu"), "model.position": (m.position, "rope")}
    gpt2 = {
        "model.norm": (m.norm, "layernorm"),
        "model.activation": (m.activation, "gelu"),
        "model.position": (m.position, "learned"),
        "model.bias": (m.bias, True),
        "model.num_kv_heads": (m.num_kv_heads or m.num_heads, m.num_heads),
    }
    for name, wanted in (("llama", llama), ("gpt2", gpt2)):
        if all(value == need for value, need in wanted.values()):
            return name
    problems = [
        Problem(key, value, f"GPT-2 format needs {need!r}", "pick a GPT-style or Llama-style model")
        for key, (value, need) in gpt2.items()
        if value != need
    ]
    problems += [
        Problem(key, value, f"Llama format needs {need!r}", "pick a GPT-style or Llama-style model")
        for key, (value, need) in llama.items()
        if value != need
    ]
    raise UserError(problems, title="this model flavour matches neither Llama nor GPT-2")


def rules(m: ModelConfig) -> list[Rule]:
    """The whole table for the model's style."""
    return _llama_rules(m) if style_of(m) == "llama" else _gpt2_rules(m)


def _qkv_rows(m: ModelConfig) -> int:
    return (m.num_heads + 2 * (m.num_kv_heads or m.num_heads)) * (m.hidden_size // m.num_heads)


def _llama_rules(m: ModelConfig) -> list[Rule]:
    out = [_one("model.embed_tokens.weight", "embed.weight"), _one("model.norm.weight", "norm.weight")]
    if not m.tie_embeddings:
        out.append(_one("lm_head.weight", "head.weight"))
    suffixes = ("weight", "bias") if m.bias else ("weight",)
    fused = {("self_attn", "qkv_proj"): _qkv_rows(m), ("mlp", "gate_up_proj"): 2 * m.ffn_hidden_size}
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out += [
            _one(f"{dst}input_layernorm.weight", f"{src}attn_norm.weight"),
            _one(f"{dst}post_attention_layernorm.weight", f"{src}mlp_norm.weight"),
        ]
        for (parent, linear), rows in fused.items():
            ours = f"{src}{parent.replace('self_attn', 'attn')}.{linear}"
            out += [_fused(m, tuple(f"{dst}{parent}.{part}.{s}" for part in FUSED[linear]), f"{ours}.{s}", rows=rows) for s in suffixes]
        for theirs, ours in (("self_attn.o_proj", "attn.o_proj"), ("mlp.down_proj", "mlp.down_proj")):
            out += [_one(f"{dst}{theirs}.{s}", f"{src}{ours}.{s}") for s in suffixes]
    return out


def _gpt2_rules(m: ModelConfig) -> list[Rule]:
    out = [
        _one("transformer.wte.weight", "embed.weight"),
        _one("transformer.wpe.weight", "pos_embed.weight"),
        _one("transformer.ln_f.weight", "norm.weight"),
        _one("transformer.ln_f.bias", "norm.bias"),
    ]
    if not m.tie_embeddings:
        out.append(_one("lm_head.weight", "head.weight"))
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        out += [
            _fused(m, (dst + "attn.c_attn.weight",), src + "attn.qkv_proj.weight", rows=_qkv_rows(m), transpose=True),
            _fused(m, (dst + "attn.c_attn.bias",), src + "attn.qkv_proj.bias", rows=_qkv_rows(m)),
        ]
        for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj")):
            out += [_one(f"{dst}{theirs}.weight", f"{src}{ours}.weight", transpose=True), _one(f"{dst}{theirs}.bias", f"{src}{ours}.bias")]
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out += [_one(f"{dst}{theirs}.{s}", f"{src}{ours}.{s}") for s in ("weight", "bias")]
    return out


def to_hf(weights: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """llmforge tensors -> Hugging Face tensors."""
    out: dict[str, torch.Tensor] = {}
    for rule in rules(m):
        out.update(rule.to_hf(weights.__getitem__))
    return out


def from_hf(get: Callable[[str], torch.Tensor], m: ModelConfig, *, wanted: Iterable[str]) -> dict[str, torch.Tensor]:
    """The llmforge tensors named in ``wanted`` (with tied embeddings, ``head.weight``
    is the embedding), read through ``get(hf_name)``: only the rules they need."""
    wanted = set(wanted)
    out: dict[str, torch.Tensor] = {}
    for rule in rules(m):
        if wanted.intersection(rule.ours):
            out.update(rule.from_hf(get))
    if "head.weight" in wanted and "head.weight" not in out and m.tie_embeddings:
        out["head.weight"] = from_hf(get, m, wanted=["embed.weight"])["embed.weight"]
    return {k: v for k, v in out.items() if k in wanted}
