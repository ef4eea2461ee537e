"""LatentMoE: sparse dispatch == dense masked reference; router selects biased, weights unbiased; HF names."""

from __future__ import annotations

import pytest
import torch

from k3.config import variant
from k3.model.mlp import situ
from k3.model.moe import LatentExperts, LatentMoE, Router
from k3.model.model import KimiK3ForCausalLM


@pytest.fixture(scope="module")
def tiny_moe():
    torch.manual_seed(0)
    cfg = variant("tiny")
    model = KimiK3ForCausalLM(cfg)
    moe = model.model.layers[1].block_sparse_moe
    with torch.no_grad():  # a nonzero correction bias so selection and weighting really differ
        moe.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
    return cfg, moe


def dense_reference(moe: LatentMoE, cfg, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, masked by the router's top-k weights, then norm, up and shared."""
    scores = torch.sigmoid(x @ moe.gate.weight.T)
    chosen = torch.topk(scores + moe.gate.e_score_correction_bias, cfg.num_experts_per_token, -1).indices
    mask = torch.zeros_like(scores).scatter(-1, chosen, 1.0)
    weights = scores * mask
    weights = weights / weights.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    z = moe.routed_expert_down_proj(x)
    ex = moe.experts
    u = torch.zeros_like(z)
    for e in range(cfg.num_experts):
        y_e = situ(z @ ex.w1[e].T, z @ ex.w3[e].T) @ ex.w2[e].T
        u = u + weights[:, e:e + 1] * y_e
    u = u / torch.sqrt((u * u).mean(-1, keepdim=True) + cfg.rms_norm_eps) * moe.routed_expert_norm.weight
    return moe.routed_expert_up_proj(u) + moe.shared_experts(x)


def test_sparse_dispatch_equals_dense_reference(tiny_moe):
    cfg, moe = tiny_moe
    x = torch.randn(13, cfg.hidden_size)
    torch.testing.assert_close(moe(x), dense_reference(moe, cfg, x), atol=1e-5, rtol=0)
    x3 = torch.randn(2, 5, cfg.hidden_size)
    torch.testing.assert_close(moe(x3), dense_reference(moe, cfg, x3.reshape(10, -1)).view(2, 5, -1),
                               atol=1e-5, rtol=0)


def test_router_selects_by_biased_score_but_weights_by_unbiased_score():
    cfg = variant("tiny").replace(num_experts=4, num_experts_per_token=2, hidden_size=4)
    router = Router(cfg)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    with torch.no_grad():
        router.weight.copy_(torch.diag(logits))  # x = e_0 + e_1 + e_2 + e_3 gives these logits
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.9]))
    experts, weights = router(torch.ones(1, 4))
    s = torch.sigmoid(logits)
    # unbiased top-2 would be {0, 1}; the bias lifts expert 3 (0.269 + 0.9) above expert 1 (0.731)
    assert sorted(experts[0].tolist()) == [0, 3]
    got = dict(zip(experts[0].tolist(), weights[0].tolist()))
    assert got[0] == pytest.approx(float(s[0] / (s[0] + s[3])), rel=1e-6)
    assert got[3] == pytest.approx(float(s[3] / (s[0] + s[3])), rel=1e-6)
    assert weights.dtype == torch.float32


def test_routed_scaling_factor_and_no_renormalisation():
    cfg = variant("tiny").replace(num_experts=4, num_experts_per_token=2, hidden_size=4,
                                  routed_scaling_factor=2.5, moe_renormalize=False)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.diag(torch.tensor([2.0, 1.0, 0.0, -1.0])))
        router.e_score_correction_bias.zero_()
    experts, weights = router(torch.ones(1, 4))
    assert experts[0].tolist() == [0, 1]
    torch.testing.assert_close(weights[0], 2.5 * torch.sigmoid(torch.tensor([2.0, 1.0])))


def test_experts_speak_hf_per_expert_names(tiny_moe):
    cfg, moe = tiny_moe
    sd = moe.experts.state_dict()
    assert set(sd) == {f"{e}.{w}.weight" for e in range(cfg.num_experts) for w in ("w1", "w2", "w3")}
    assert sd["3.w1.weight"].shape == (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size)
    assert sd["3.w2.weight"].shape == (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size)
    assert torch.equal(sd["5.w3.weight"], moe.experts.w3[5])
    fresh = LatentExperts(cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, 4.0, 25.0)
    fresh.load_state_dict({k: v.clone() for k, v in sd.items()})
    for w in ("w1", "w2", "w3"):
        assert torch.equal(getattr(fresh, w), getattr(moe.experts, w))


def test_missing_and_extra_experts_are_named(tiny_moe):
    cfg, moe = tiny_moe
    sd = {k: v.clone() for k, v in moe.experts.state_dict().items()}
    del sd["2.w1.weight"]
    sd["8.w1.weight"] = sd["0.w1.weight"]
    fresh = LatentExperts(cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, 4.0, 25.0)
    result = fresh.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["2.w1.weight"]
    assert result.unexpected_keys == ["8.w1.weight"]
    sd_bad = {k: v.clone() for k, v in moe.experts.state_dict().items()}
    sd_bad["1.w2.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"\*\.w2\.weight: shapes"):
        fresh.load_state_dict(sd_bad)


def test_zero_input_gives_zero_output(tiny_moe):
    # padding tokens enter as exact zeros and must leave as exact zeros
    cfg, moe = tiny_moe
    assert torch.equal(moe(torch.zeros(3, cfg.hidden_size)), torch.zeros(3, cfg.hidden_size))


def test_moe_backward_matches_dense_reference(tiny_moe):
    cfg, moe = tiny_moe
    x = torch.randn(6, cfg.hidden_size, requires_grad=True)
    (g_sparse,) = torch.autograd.grad(moe(x).square().sum(), x)
    x2 = x.detach().clone().requires_grad_()
    (g_dense,) = torch.autograd.grad(dense_reference(moe, cfg, x2).square().sum(), x2)
    torch.testing.assert_close(g_sparse, g_dense, atol=1e-5, rtol=1e-4)
