"""The MoE layer: routing, batched experts, capacity dropping, router losses, balance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmforge.config.schema import ModelConfig, MoEConfig
from llmforge.models.gpt import GPT
from llmforge.models.moe import MoE, capacity_keep, load_balancing_loss, moe_metrics, route, set_aux_loss_scale, update_expert_bias, z_loss
from llmforge.train.step import cross_entropy


def moe_config(*, hidden: int = 32, activation: str = "gelu", **moe) -> ModelConfig:
    settings = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 24, **moe}
    return ModelConfig(
        num_layers=2,
        hidden_size=hidden,
        num_heads=4 if hidden % 4 == 0 else 1,
        ffn_hidden_size=64,
        vocab_size=64,
        seq_len=16,
        activation=activation,
        moe=MoEConfig(**settings),
    )


def seeded(layer: MoE, seed: int = 0) -> MoE:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def per_token_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE output computed one token and one expert at a time."""
    cap = None if layer.capacity_factor is None else max(1, -(-int(layer.capacity_factor * x.shape[0] * layer.top_k) // layer.num_experts))
    routing = route(layer.router(x), top_k=layer.top_k, normalize=layer.normalize_top_k, capacity=cap)
    e = layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            if not routing.keep[t, j]:
                continue
            i = int(routing.experts[t, j])
            up = x[t] @ e.w_up[i]
            act = F.silu(x[t] @ e.w_gate[i]) * up if e.w_gate is not None else F.gelu(up, approximate="tanh")
            out[t] += routing.weights[t, j] * (act @ e.w_down[i])
    return out + (layer.shared(x) if layer.shared is not None else 0)


@pytest.mark.parametrize(
    "activation,normalize,capacity,shared", [("gelu", True, None, 0), ("swiglu", False, None, 1), ("swiglu", True, 1.0, 2)]
)
def test_batched_experts_match_a_per_token_loop(activation: str, normalize: bool, capacity, shared: int) -> None:
    layer = seeded(
        MoE(moe_config(activation=activation, normalize_top_k=normalize, capacity_factor=capacity, num_shared_experts=shared))
    ).eval()
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    # fp32 rounding: batched matmuls sum in another order than the per-token loop
    torch.testing.assert_close(layer(x), per_token_reference(layer, x), rtol=1e-5, atol=1e-5)


def test_top_k_weights_renormalise_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.allclose(route(logits, top_k=2, normalize=True, capacity=None).weights.sum(), torch.tensor(1.0))
    raw = route(logits, top_k=2, normalize=False, capacity=None).weights
    torch.testing.assert_close(raw, logits.softmax(-1)[:, :2])


# Fixed routing of 6 tokens over 3 experts, top-2 (rows: first, second choice).
FIXED = [[0, 1], [0, 2], [0, 1], [1, 0], [2, 0], [0, 2]]


def test_capacity_drops_the_hand_computed_assignments() -> None:
    # capacity = ceil(1.0 * 6 tokens * 2 / 3 experts) = 4. First choices go first:
    # expert 0 takes tokens 0, 1, 2, 5 and is full; tokens 3 and 4 lose their second choice (0).
    keep = capacity_keep(torch.tensor(FIXED), num_experts=3, capacity=4)
    expected = torch.ones(6, 2, dtype=torch.bool)
    expected[3, 1] = expected[4, 1] = False
    assert torch.equal(keep, expected)
    # capacity 2: expert 0 keeps tokens 0, 1; expert 1 tokens 3, then token 0's second choice;
    # expert 2 token 4, then token 1's second choice.
    keep2 = capacity_keep(torch.tensor(FIXED), num_experts=3, capacity=2)
    assert keep2.tolist() == [[True, True], [True, True], [False, False], [True, False], [True, False], [False, False]]


def test_moe_layer_drops_and_counts_on_a_fixed_routing() -> None:
    layer = seeded(MoE(moe_config(hidden=3, num_experts=3, top_k=2, capacity_factor=1.0)))
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(3))  # logits = the token itself
    x = torch.zeros(6, 3)
    for t, (first, second) in enumerate(FIXED):
        x[t, first], x[t, second] = 2.0, 1.0
    out = layer(x)
    metrics = moe_metrics([layer])
    assert metrics["moe/dropped_frac"] == pytest.approx(2 / 12)
    assert metrics["moe/load_imbalance"] == pytest.approx(6 / 4)  # routed (pre-drop) loads 6, 3, 3
    torch.testing.assert_close(out, per_token_reference(layer, x))
    assert moe_metrics([layer]) == {}  # reset after reading


def test_router_losses_reach_the_gradient_as_if_added_to_the_loss() -> None:
    cfg = moe_config(activation="swiglu", num_shared_experts=1, aux_loss_coef=0.3, z_loss_coef=0.05)
    model = GPT(cfg)
    model.init_weights(seed=2)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    microbatches = 4
    set_aux_loss_scale([model], scale=lambda: 1.0 / microbatches)
    (cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]) / microbatches).backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    set_aux_loss_scale([model], scale=lambda: 0.0)
    captured = []
    for layer in (b.mlp for b in model.layers.values()):
        layer.register_forward_hook(lambda mod, inp, out: captured.append(_router_loss(mod, inp[0])))
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]) + sum(captured)
    (loss / microbatches).backward()
    router = "layers.0.mlp.router.weight"
    assert injected[router].abs().max() > 0
    for name, grad in injected.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-5, atol=1e-7, msg=name)


def _router_loss(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    routing = route(layer.router(x.reshape(-1, x.shape[-1])), top_k=layer.top_k, normalize=True, capacity=None)
    return layer.aux_loss_coef * load_balancing_loss(routing) + layer.z_loss_coef * z_loss(routing.logits)


def test_balanced_routing_has_aux_loss_one() -> None:
    probs = torch.full((8, 4), 0.25)
    experts = torch.tensor([[0, 1], [2, 3]] * 4)
    routing = route(torch.zeros(8, 4), top_k=2, normalize=True, capacity=None)
    routing.experts, routing.probs = experts, probs
    assert float(load_balancing_loss(routing)) == pytest.approx(1.0)


def _toy_run(*, aux_loss_coef: float, seed: int, steps: int = 30, balance: str = "aux") -> list[dict]:
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        vocab_size=64,
        seq_len=16,
        moe=MoEConfig(num_experts=4, top_k=1, ffn_hidden_size=32, aux_loss_coef=aux_loss_coef, z_loss_coef=0.0, balance=balance),
    )
    model = GPT(cfg)
    model.init_weights(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(seed))
    history = []
    for _ in range(steps):
        cross_entropy(model(data[:, :-1]), data[:, 1:]).backward()
        opt.step()
        update_expert_bias([model], rate=0.01)
        opt.zero_grad()
        history.append(moe_metrics([model]))
    return history


def test_aux_loss_reduces_load_imbalance_on_a_toy_run() -> None:
    def late_cv(history: list[dict]) -> float:
        return sum(h["moe/load_cv"] for h in history[-10:]) / 10

    free, balanced = _toy_run(aux_loss_coef=0.0, seed=0), _toy_run(aux_loss_coef=0.1, seed=0)
    assert late_cv(balanced) < 0.75 * late_cv(free), (late_cv(balanced), late_cv(free))
    assert balanced[-1]["moe/aux_loss"] < free[-1]["moe/aux_loss"]


def test_bias_balancing_reduces_load_imbalance_without_an_aux_loss() -> None:
    def late_cv(history: list[dict]) -> float:
        return sum(h["moe/load_cv"] for h in history[-10:]) / 10

    free, biased = _toy_run(aux_loss_coef=0.1, seed=0, balance="none"), _toy_run(aux_loss_coef=0.1, seed=0, balance="bias")
    assert late_cv(biased) < 0.75 * late_cv(free), (late_cv(biased), late_cv(free))


def test_the_bias_chooses_experts_and_leaves_the_weights_alone() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain = route(logits, top_k=2, normalize=False, capacity=None)
    biased = route(logits, top_k=2, normalize=False, capacity=None, bias=torch.tensor([-1.0, 0.0, 0.5, 0.0]))
    assert plain.experts.tolist() == [[0, 1]] and biased.experts.tolist() == [[2, 1]]
    torch.testing.assert_close(biased.weights, plain.probs[:, [2, 1]])


def test_bias_update_follows_the_sign_of_the_load_gap_and_its_reduction() -> None:
    model = GPT(moe_config(balance="bias"))
    model.init_weights(seed=0)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.expert_load.copy_(torch.tensor([5, 1, 3, 3]))
    seen = []
    update_expert_bias([model], rate=0.5, reduce=lambda t: (seen.append(t.shape), t.mul_(2)))
    assert seen == [torch.Size([2, 4])]  # one collective for all layers
    for layer in layers:
        assert layer.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0] and layer.expert_load.sum() == 0
    assert "layers.0.mlp.expert_bias" in model.state_dict() and "layers.0.mlp.expert_load" not in model.state_dict()


def test_balance_bias_and_none_drop_the_aux_loss_from_the_gradient() -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    grads = {}
    for balance, coef in (("aux", 0.0), ("bias", 1.0), ("none", 1.0)):
        layer = seeded(MoE(moe_config(balance=balance, aux_loss_coef=coef, z_loss_coef=0.0)))
        layer(x).sum().backward()
        grads[balance] = layer.router.weight.grad
    torch.testing.assert_close(grads["bias"], grads["aux"], rtol=0, atol=0)
    torch.testing.assert_close(grads["none"], grads["aux"], rtol=0, atol=0)


def test_the_routing_bias_is_saved_and_restored(tmp_path) -> None:
    from llmforge.checkpoint import store
    from llmforge.config.schema import OptimConfig
    from llmforge.train.optim import build_optimizer

    def built() -> tuple[GPT, torch.optim.Optimizer]:
        model = GPT(moe_config(balance="bias"))
        model.init_weights(seed=0)
        return model, build_optimizer(model, optim=OptimConfig(), lr=1e-3)

    model, opt = built()
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()  # optimizer state exists, as in a real checkpoint
    with torch.no_grad():
        model.layers["1"].mlp.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, -0.4]))
    saver = store.CheckpointSaver(root=tmp_path, keep=1, async_save=False, rank=0, log=lambda t: None)
    path = saver.save(step=1, model_parts=[model], optimizer=opt, train_state={}, plan={})
    fresh, fresh_opt = built()
    store.load(path=path, model_parts=[fresh], optimizer=fresh_opt)
    assert fresh.layers["1"].mlp.expert_bias.tolist() == pytest.approx([0.1, -0.2, 0.3, -0.4])
