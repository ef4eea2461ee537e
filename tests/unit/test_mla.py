"""Gated NoPE MLA against a naive per-head loop; latent cache decode; masked padded keys."""

from __future__ import annotations

import math

import pytest
import torch

from k3.config import variant
from k3.model.cache import K3Cache, MLALayerState
from k3.model.mla import MLAttention, attention_allowed
from k3.model.model import KimiK3ForCausalLM

ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny_mla():
    torch.manual_seed(0)
    cfg = variant("tiny")
    model = KimiK3ForCausalLM(cfg)
    layer = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i))
    return cfg, model.model.layers[layer].self_attn


def naive_mla(attn: MLAttention, cfg, x: torch.Tensor, real: list[bool] | None = None) -> torch.Tensor:
    """Per batch row, head and query position, straight from architecture §2.3."""
    b, s, _ = x.shape
    nh, nope, rope, vd, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.v_head_dim, cfg.kv_lora_rank)

    def rms(t, w, eps):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * w

    out = torch.zeros(b, s, nh * vd)
    for bi in range(b):
        xa = x[bi]
        q = attn.q_b_proj(rms(attn.q_a_proj(xa), attn.q_a_layernorm.weight, 1e-6)).view(s, nh, nope + rope)
        c = attn.kv_a_proj_with_mqa(xa)
        kv = attn.kv_b_proj(rms(c[:, :r], attn.kv_a_layernorm.weight, 1e-6)).view(s, nh, nope + vd)
        k_shared = c[:, r:]
        gate = torch.sigmoid(attn.g_proj(xa)).view(s, nh, vd)
        for h in range(nh):
            for i in range(s):
                keys = [j for j in range(i + 1) if real is None or real[j]] or list(range(i + 1))
                scores = torch.stack([
                    (q[i, h, :nope] @ kv[j, h, :nope] + q[i, h, nope:] @ k_shared[j]) / math.sqrt(nope + rope)
                    for j in keys
                ])
                p = torch.softmax(scores, 0)
                o = sum(p[n] * kv[j, h, nope:] for n, j in enumerate(keys))
                out[bi, i, h * vd:(h + 1) * vd] = o * gate[i, h]
    return attn.o_proj(out)


def test_latent_norm_eps_follows_the_reference(tiny_mla):
    cfg, attn = tiny_mla
    assert cfg.mla_latent_norm_eps == 1e-6
    assert attn.q_a_layernorm.eps == 1e-6 and attn.kv_a_layernorm.eps == 1e-6
    assert attn.scale == pytest.approx(1 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))


def test_matches_naive_per_head_loop(tiny_mla):
    cfg, attn = tiny_mla
    x = torch.randn(2, 5, cfg.hidden_size)
    torch.testing.assert_close(attn(x), naive_mla(attn, cfg, x), atol=ATOL, rtol=0)


def test_decode_with_latent_cache_equals_full(tiny_mla):
    cfg, attn = tiny_mla
    x = torch.randn(2, 7, cfg.hidden_size)
    full = attn(x)
    state = MLALayerState(torch.zeros(2, 0, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    steps = [attn(x[:, :3], state=state)] + [attn(x[:, t:t + 1], state=state) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=0)
    assert state.latent.shape == (2, 7, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_latent_per_token_is_576_for_the_full_config():
    cfg = variant("full")
    cache_layer = K3Cache(cfg.replace(num_hidden_layers=4), 1, torch.bfloat16, "meta").layers[3]
    assert isinstance(cache_layer, MLALayerState) and cache_layer.latent.shape[-1] == 576


def test_padded_keys_are_masked(tiny_mla):
    cfg, attn = tiny_mla
    x = torch.randn(1, 6, cfg.hidden_size)
    real = [False, False, True, True, True, True]
    mask = torch.tensor([real])
    got = attn(x, key_mask=mask)
    torch.testing.assert_close(got, naive_mla(attn, cfg, x, real), atol=ATOL, rtol=0)
    torch.testing.assert_close(got[:, 2:], attn(x[:, 2:]), atol=ATOL, rtol=0)
    assert torch.isfinite(got).all()


def test_attention_allowed_never_leaves_a_row_empty():
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    allowed = attention_allowed(2, 2, mask, torch.device("cpu"))  # queries at positions 2, 3
    assert allowed.shape == (2, 1, 2, 4)
    assert allowed[0, 0].tolist() == [[False, False, True, False], [False, False, True, True]]
    assert allowed[1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    pad_queries = attention_allowed(2, 0, torch.tensor([[False, False]]), torch.device("cpu"))
    assert pad_queries[0, 0].tolist() == [[True, False], [True, True]]
