"""Which block linears float8 runs: one rule from shapes alone (llmforge.blockspec.fp8), read
by the plan and the estimator, and applied exactly by the backend."""

from __future__ import annotations

import pytest

from llmforge.blockspec.fp8 import block_fp8_linears, fp8_choice_of
from llmforge.config.compose import compose
from llmforge.estimate.inventory import inventory
from llmforge.estimate.shape import shape_from_config
from llmforge.layout import Layout

QKV, O, UP, GATE_UP, DOWN = "attn.qkv_proj", "attn.o_proj", "mlp.up_proj", "mlp.gate_up_proj", "mlp.down_proj"

#: recipe, fp8_recipe -> the linears float8 runs at that width (torchao's size rule).
TABLE = [
    ("gpt-125m", "tensorwise", {QKV, UP}),  # 768: o (768 x 768) and down (768 <- 3072) are too small
    ("gpt-125m", "rowwise", set()),
    ("gpt-1b", "tensorwise", {QKV, O, UP, DOWN}),  # 2048: all four
    ("gpt-1b", "rowwise", {QKV, UP}),
    ("llama-8b", "tensorwise", {QKV, O, GATE_UP, DOWN}),  # 4096: all four
    ("llama-8b", "rowwise", {QKV, O, GATE_UP, DOWN}),
]


@pytest.mark.parametrize("recipe,scaling,expected", TABLE)
def test_float8_linears_by_shape(recipe, scaling, expected):
    config = compose([f"recipe={recipe}", "precision=fp8", f"precision.fp8_recipe={scaling}"])
    assert fp8_choice_of(config).dense == expected
    shape = shape_from_config(config.model, precision=config.precision)
    kept = {x.name: x.why for x in block_fp8_linears(shape, moe=False, recipe=scaling, linears="auto") if not x.float8}
    every = {x.name for x in block_fp8_linears(shape, moe=False, recipe=scaling, linears="all") if x.float8}
    assert all("too small" in why for why in kept.values()) and set(kept) | expected == every
    converted = {t.name.removesuffix(".weight") for t in inventory(shape, Layout()).dense.converted}
    assert converted == expected  # the estimator counts the same linears


def test_all_converts_every_aligned_linear_but_never_the_router():
    config = compose(["recipe=moe-tiny", "precision=fp8", "precision.fp8_linears=all", "model.moe.num_shared_experts=1"])
    choice = fp8_choice_of(config)
    assert "mlp.router" not in choice.moe and "mlp.shared.gate_up_proj" in choice.moe and QKV in choice.moe
    unaligned = compose(["recipe=tiny", "precision=fp8", "precision.fp8_linears=all", "model.ffn_hidden_size=520"])
    assert fp8_choice_of(unaligned).dense == {QKV, O}  # 520 is not a multiple of 16


def test_the_backend_converts_exactly_the_chosen_linears():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from llmforge.blockspec.fp8 import Fp8Choice
    from llmforge.parallel.float8 import apply_float8
    from llmforge.testing.harness import tiny_plan
    from llmforge.train.build import build_model

    plan = tiny_plan(["precision.fp8_linears=all"])
    model = build_model(plan, device=torch.device("cpu"))
    choice = Fp8Choice(dense=frozenset({QKV, UP}), moe=frozenset())
    assert apply_float8(model, recipe="tensorwise", emulate=True, fsdp_all_gather=False, choice=choice) == 2 * len(model.layers)
    kinds = {n: type(m).__name__ for n, m in model.layers["0"].named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {QKV: "Float8Linear", O: "Linear", UP: "Float8Linear", DOWN: "Linear"}
    with pytest.raises(RuntimeError, match="the plan chose"):  # a name the model lacks: model and description disagree
        apply_float8(
            build_model(plan, device=torch.device("cpu")),
            recipe="tensorwise",
            emulate=True,
            fsdp_all_gather=False,
            choice=Fp8Choice(dense=frozenset({"attn.q_proj"}), moe=frozenset()),
        )
