"""kiln's GPT with a mixture of experts: routing, dispatch, capacity, balancing, sizes, config."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ConfigError, ModelConfig
from kiln.models.gpt import GPT, build_gpt_config, param_count
from kiln.models.gpt.model import MLP, moe
from kiln.models.gpt.moe import MoE, grouped_mm


def moe_config(**overrides):
    cfg = build_gpt_config(ModelConfig(preset="tiny-moe", d_model=32, n_head=4, d_expert=16, d_ff=48), 97, 32)
    return dataclasses.replace(cfg, **overrides)


def layer(seed=0, **overrides) -> MoE:
    torch.manual_seed(seed)
    made = moe(moe_config(**overrides))
    for p in made.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return made


def reference(mixture: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed token by token, as its definition reads."""
    rows = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = mixture.router(token)
        scores = logits.sigmoid() if mixture.sigmoid else logits.softmax(-1)
        chosen = torch.topk(scores + mixture.expert_bias, mixture.k).indices
        weights = scores[chosen] / scores[chosen].sum() if mixture.k > 1 else scores[chosen]
        out = sum(
            w * (F.silu(token @ mixture.experts.w1[e].T) * (token @ mixture.experts.w3[e].T)) @ mixture.experts.w2[e].T
            for e, w in zip(chosen.tolist(), weights, strict=True)
        )
        rows.append(out + (mixture.shared(token) if mixture.shared is not None else 0))
    return torch.stack(rows).view(x.shape)


def test_the_private_grouped_gemm_is_still_there_and_agrees_with_the_loop():
    """kiln calls ``torch._grouped_mm`` (private) in one place; this fails when upstream changes it."""
    assert hasattr(torch, "_grouped_mm")
    torch.manual_seed(0)
    x, w = torch.randn(10, 8), torch.randn(3, 16, 8)
    ends = torch.tensor([3, 3, 10], dtype=torch.int32)  # the second expert gets no rows
    native = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    looped = torch.cat([x[:3] @ w[0].T, x[3:10] @ w[2].T])
    torch.testing.assert_close(native, looped)
    torch.testing.assert_close(grouped_mm(x, w, ends), looped)
    torch.testing.assert_close(grouped_mm(x, w, ends, native=False), looped)
    torch.testing.assert_close(grouped_mm(x.bfloat16(), w.bfloat16(), ends).float(), looped, atol=0.2, rtol=0.05)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # sigmoid scores, top-2, a shared expert (DeepSeek-V3's routing)
        {"router": "softmax", "n_shared_experts": 0},  # Qwen3-MoE's
        {"router": "softmax", "experts_per_token": 1},  # one expert: its raw score weighs it
    ],
)
def test_dispatch_equals_routing_each_token_by_itself(overrides):
    mix = layer(**overrides)
    mix.expert_bias.copy_(torch.randn(mix.n_experts) * 0.1)
    x = torch.randn(3, 7, 32)
    torch.testing.assert_close(mix(x), reference(mix, x), atol=1e-5, rtol=1e-5)


def test_gradients_match_the_per_token_reference():
    mix = layer()
    x = torch.randn(2, 5, 32, requires_grad=True)
    mix(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in mix.parameters()]
    x.grad = None
    mix.zero_grad()
    reference(mix, x).square().sum().backward()
    for a, b in zip(got, [x.grad] + [p.grad for p in mix.parameters()], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_bias_steers_the_choice_but_not_the_weights():
    mix = layer(n_shared_experts=0)
    x = torch.randn(4, 6, 32)
    mix.expert_bias[3] = 10.0  # every token picks expert 3 among its two
    mix(x)
    assert mix.expert_load[3] == 24 and mix.expert_load.sum() == 48
    torch.testing.assert_close(mix(x), reference(mix, x), atol=1e-5, rtol=1e-5)


def test_a_capacity_drops_the_pairs_past_it_in_token_order():
    mix = layer(expert_capacity=1.0, n_shared_experts=0)
    mix.expert_bias[0] = 10.0  # 24 tokens all want expert 0, whose capacity is 24 * 2 / 8 = 6
    x = torch.randn(4, 6, 32)
    kept = mix(x).reshape(24, 32)
    assert mix.dropped == 18
    uncapped = layer(n_shared_experts=0)
    uncapped.expert_bias[0] = 10.0
    full = uncapped(x).reshape(24, 32)
    torch.testing.assert_close(kept[:6], full[:6])  # the first six tokens keep both their experts
    assert not torch.allclose(kept[6:], full[6:])


def test_counts_are_kept_in_training_mode_only_and_the_bias_moves_towards_an_even_load():
    mix = layer()
    mix.eval()
    mix(torch.randn(2, 4, 32))
    assert mix.expert_load.sum() == 0
    mix.train()
    mix(torch.randn(2, 4, 32))
    assert mix.expert_load.sum() == 16
    mix.update_bias(torch.tensor([8.0, 0, 0, 0, 0, 0, 0, 8]))
    rate = mix.bias_rate
    assert mix.expert_bias.tolist() == pytest.approx([-rate] + [rate] * 6 + [-rate])


def test_the_balance_loss_is_added_to_the_training_loss():
    cfg = moe_config(router_aux_loss=0.01)
    torch.manual_seed(0)
    with_aux = GPT(cfg)
    without = GPT(dataclasses.replace(cfg, router_aux_loss=0.0))
    without.load_state_dict(with_aux.state_dict())
    idx = torch.randint(0, 97, (2, 16))
    extra = with_aux(idx, targets=idx) - without(idx, targets=idx)
    # n_experts * sum(f * P) is 1 when balanced and at least about 1: one such term per MoE layer (3).
    assert 0.02 < extra.item() < 0.1
    extra.backward()
    assert with_aux.blocks[1].mlp.router.weight.grad.abs().sum() > 0


def test_parameter_counts_total_and_active():
    cfg = moe_config()
    model = GPT(cfg)
    assert param_count(cfg) == model.num_params()
    d, de = cfg.d_model, cfg.d_expert
    idle = (cfg.n_experts - cfg.experts_per_token) * 3 * d * de
    assert param_count(cfg) - param_count(cfg, active=True) == idle * (cfg.n_layer - cfg.moe_layer_start)
    assert isinstance(model.blocks[0].mlp, MLP) and all(isinstance(b.mlp, MoE) for b in model.blocks[1:])


def test_the_balancing_bias_is_kept_in_the_state_dict_and_the_counts_are_not():
    keys = GPT(moe_config()).state_dict().keys()
    assert "blocks.1.mlp.expert_bias" in keys
    assert not any(k.endswith(("expert_load", "dropped", "entropy")) for k in keys)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"experts_per_token": 9}, "model.experts_per_token: 9 is more than model.n_experts 8"),
        ({"router": "relu"}, "model.router: 'relu' is not one of softmax, sigmoid, preset"),
        ({"moe_layer_start": 4}, "model.moe_layer_start: 4 leaves no layer of model.n_layer 4"),
        ({"expert_capacity": 0.2}, "model.expert_capacity: 0.2 gives each expert less than one token's share"),
        ({"router_bias_rate": -1.0}, "model.router_bias_rate: must be >= 0"),
        ({"n_shared_experts": -2}, "model.n_shared_experts: must be >= 0"),
    ],
)
def test_bad_expert_settings_are_named(sets, message):
    with pytest.raises(ConfigError, match=message):
        build_gpt_config(ModelConfig(preset="tiny-moe", **sets), 97, 32)


def test_a_dense_preset_given_experts_becomes_a_mixture():
    cfg = build_gpt_config(ModelConfig(preset="tiny", n_experts=4), 97, 32)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.d_expert, cfg.router) == (4, 2, cfg.d_ff, "softmax")
    assert build_gpt_config(ModelConfig(preset="tiny"), 97, 32).n_experts == 0
