"""llmforge <-> Hugging Face parameter names: one table, read in both directions.

Each :class:`Rule` ties one Hugging Face tensor to one or more llmforge tensors.
``export`` reads the table forwards (llmforge -> HF), ``model.init_from`` backwards.

- ``llama`` (``LlamaForCausalLM``): a rename, tensor for tensor.
- ``gpt2`` (``GPT2LMHeadModel``): q/k/v fuse into ``c_attn`` along the output
  dimension, and every linear weight is transposed, because GPT-2 uses ``Conv1D``
  (``y = x @ W + b``, weight ``[in, out]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Tuple

import torch

from llmforge.config.schema import ModelConfig
from llmforge.errors import Problem, UserError


@dataclass(frozen=True)
class Rule:
    """``hf`` is ``cat(ours, dim=0)``, transposed when ``transpose``."""

    hf: str
    ours: Tuple[str, ...]
    transpose: bool = False

    def to_hf(self, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        parts = [get(name) for name in self.ours]
        tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        return tensor.t() if self.transpose else tensor

    def from_hf(self, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        tensor = tensor.t() if self.transpose else tensor
        return dict(zip(self.ours, tensor.chunk(len(self.ours), dim=0)))


def style_of(m: ModelConfig) -> str:
    """``llama`` or ``gpt2``; a UserError listing what matches neither."""
    if m.moe.num_experts > 0:
        raise UserError([Problem("model.moe.num_experts", m.moe.num_experts, "MoE models have no Llama/GPT-2 format", "use a dense model")], title="no Hugging Face format for this model")
    llama = {"model.norm": (m.norm, "rmsnorm"), "model.activation": (m.activation, "swiglu"), "model.position": (m.position, "rope")}
    gpt2 = {"model.norm": (m.norm, "layernorm"), "model.activation": (m.activation, "gelu"), "model.position": (m.position, "learned"), "model.bias": (m.bias, True), "model.num_kv_heads": (m.num_kv_heads or m.num_heads, m.num_heads)}
    for name, wanted in (("llama", llama), ("gpt2", gpt2)):
        if all(value == need for value, need in wanted.values()):
            return name
    problems = [Problem(key, value, f"GPT-2 format needs {need!r}", "pick a GPT-style or Llama-style model") for key, (value, need) in gpt2.items() if value != need]
    problems += [Problem(key, value, f"Llama format needs {need!r}", "pick a GPT-style or Llama-style model") for key, (value, need) in llama.items() if value != need]
    raise UserError(problems, title="this model flavour matches neither Llama nor GPT-2")


def rules(m: ModelConfig) -> List[Rule]:
    """The whole table for the model's style."""
    return _llama_rules(m) if style_of(m) == "llama" else _gpt2_rules(m)


def _llama_rules(m: ModelConfig) -> List[Rule]:
    out = [Rule("model.embed_tokens.weight", ("embed.weight",)), Rule("model.norm.weight", ("norm.weight",))]
    if not m.tie_embeddings:
        out.append(Rule("lm_head.weight", ("head.weight",)))
    suffixes = ("weight", "bias") if m.bias else ("weight",)
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out += [Rule(f"{dst}input_layernorm.weight", (f"{src}attn_norm.weight",)), Rule(f"{dst}post_attention_layernorm.weight", (f"{src}mlp_norm.weight",))]
        linears = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
        for name in linears:
            ours = name.replace("self_attn.", "attn.")
            out += [Rule(f"{dst}{name}.{s}", (f"{src}{ours}.{s}",)) for s in suffixes]
    return out


def _gpt2_rules(m: ModelConfig) -> List[Rule]:
    out = [Rule("transformer.wte.weight", ("embed.weight",)), Rule("transformer.wpe.weight", ("pos_embed.weight",)),
           Rule("transformer.ln_f.weight", ("norm.weight",)), Rule("transformer.ln_f.bias", ("norm.bias",))]
    if not m.tie_embeddings:
        out.append(Rule("lm_head.weight", ("head.weight",)))
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        qkv = [f"{src}attn.{p}_proj" for p in "qkv"]
        out += [Rule(dst + "attn.c_attn.weight", tuple(k + ".weight" for k in qkv), transpose=True),
                Rule(dst + "attn.c_attn.bias", tuple(k + ".bias" for k in qkv))]
        for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj")):
            out += [Rule(f"{dst}{theirs}.weight", (f"{src}{ours}.weight",), transpose=True), Rule(f"{dst}{theirs}.bias", (f"{src}{ours}.bias",))]
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out += [Rule(f"{dst}{theirs}.{s}", (f"{src}{ours}.{s}",)) for s in ("weight", "bias")]
    return out


def to_hf(weights: Dict[str, torch.Tensor], m: ModelConfig) -> Dict[str, torch.Tensor]:
    """llmforge tensors -> Hugging Face tensors."""
    return {rule.hf: rule.to_hf(weights.__getitem__) for rule in rules(m)}


def from_hf(get: Callable[[str], torch.Tensor], m: ModelConfig, *, wanted: Iterable[str]) -> Dict[str, torch.Tensor]:
    """The llmforge tensors named in ``wanted`` (with tied embeddings, ``head.weight``
    is the embedding), read through ``get(hf_name)``: only the rules they need."""
    wanted = set(wanted)
    out: Dict[str, torch.Tensor] = {}
    for rule in rules(m):
        if wanted.intersection(rule.ours):
            out.update(rule.from_hf(get(rule.hf)))
    if "head.weight" in wanted and "head.weight" not in out and m.tie_embeddings:
        out["head.weight"] = from_hf(get, m, wanted=["embed.weight"])["embed.weight"]
    return {k: v for k, v in out.items() if k in wanted}
