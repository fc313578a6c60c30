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

from llmforge.blockspec.block import HF_BLOCK_PREFIX, HF_MODEL, HFName, Linear, Norm, describe, model_tensors
from llmforge.blockspec.dims import dims_of
from llmforge.config.schema import ModelConfig
from llmforge.errors import Problem, UserError
from llmforge.models.fused import fuse, unfuse


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
    """The whole table for the model's style, read from the block description
    (``llmforge.blockspec``): each norm's and linear's Hugging Face names, and how a fused
    linear's parts sit in its rows."""
    style, dims = style_of(m), dims_of(m)
    first, last = model_tensors(dims)
    out = [_one(HF_MODEL[style][p.name], p.name) for p in first + last]
    spec = describe(dims)
    for i in range(m.num_layers):
        prefix = HF_BLOCK_PREFIX[style].format(i=i)
        for item in (*spec.norms, *spec.linears):
            names = next(h for h in item.hf if h.style == style)
            for param in item.params():
                out.append(_rule(item, names, param.name, ours=f"layers.{i}.{param.name}", prefix=prefix))
    return out


def _rule(item: Norm | Linear, names: HFName, param: str, *, ours: str, prefix: str) -> Rule:
    suffix = param.rpartition(".")[2]
    hf = tuple(f"{prefix}{name}.{suffix}" for name in names.names)
    transpose = names.transpose and suffix == "weight"
    if isinstance(item, Linear) and item.parts:
        return Rule(hf, (ours,), transpose=transpose, sizes=tuple(rows for _, rows in item.parts), groups=item.groups)
    return Rule(hf, (ours,), transpose=transpose)


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
