"""KDA: chunked core == per-token recurrence, state carry, both gate forms, the layer's conv/state/padding."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3.config import variant
from k3.kernels.kda.chunk import MAX_FACTORED_LOG_SPAN, chunk_kda, intra_chunk_scores
from k3.kernels.kda.fla import kda_core
from k3.kernels.kda.naive import naive_recurrent_kda
from k3.model.cache import K3Cache
from k3.model.kda import KDAttention, kda_gate, l2_normalize
from k3.model.model import KimiK3ForCausalLM

ATOL = 1e-5


def make_inputs(B=2, T=37, H=3, K=8, V=6, seed=0, decay=-5.0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = decay * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("T", [1, 5, 17, 37, 50])
@pytest.mark.parametrize("chunk_size", [16, 7])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrence(T, chunk_size, with_state):
    q, k, v, g, beta, s0 = make_inputs(T=T)
    init = s0 if with_state else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=init)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=init, chunk_size=chunk_size)
    assert T % chunk_size != 0 or T == 0
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=0)


def test_strong_decay_uses_the_pairwise_form_and_still_matches():
    # softplus gate with huge rates: −Γ over a chunk far beyond e^80, where e^{Γ}·e^{−Γ} would overflow
    q, k, v, _, beta, s0 = make_inputs(T=40)
    g = -30.0 * torch.rand(q.shape, generator=torch.Generator().manual_seed(3))
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=0)


def test_factored_and_pairwise_intra_chunk_scores_agree():
    C, K = 16, 8
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, C, K, generator=gen), torch.randn(2, C, K, generator=gen)
    G = (-5.0 * torch.rand(2, C, K, generator=gen)).cumsum(-2)  # K3's bound over 16 tokens
    assert float((-G[..., -1, :]).max()) <= MAX_FACTORED_LOG_SPAN
    args = (q, k, G, G.exp() * q, G.exp() * k)
    kk_f, p_f = intra_chunk_scores(*args, factored=True)
    kk_p, p_p = intra_chunk_scores(*args, factored=False)
    torch.testing.assert_close(kk_f, kk_p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_f, p_p, atol=1e-5, rtol=1e-5)
    # closed form of one entry: KK[t, i] = Σ_d k_t k_i e^{Γ_t − Γ_i}, strictly lower; P includes the diagonal
    t, i = 9, 4
    want = float((k[0, t] * k[0, i] * (G[0, t] - G[0, i]).exp()).sum())
    assert kk_p[0, t, i].item() == pytest.approx(want, rel=1e-5)
    assert kk_p[0, i, t].item() == 0.0 and kk_p[0, t, t].item() == 0.0
    assert p_p[0, t, t].item() == pytest.approx(float((q[0, t] * k[0, t]).sum()), rel=1e-5)


@pytest.mark.parametrize("split", [1, 13, 20])
def test_two_halves_with_carried_state_equal_one_pass(split):
    q, k, v, g, beta, s0 = make_inputs(T=33)
    o_all, s_all = chunk_kda(q, k, v, g, beta, initial_state=s0)
    o1, s1 = chunk_kda(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split], initial_state=s0)
    o2, s2 = chunk_kda(q[:, split:], k[:, split:], v[:, split:], g[:, split:], beta[:, split:], initial_state=s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, atol=ATOL, rtol=0)
    torch.testing.assert_close(s2, s_all, atol=ATOL, rtol=0)


def test_recurrence_two_steps_by_hand():
    # K = V = 2, one head: S1 = β1 k1 v1ᵀ (from zero), S2 = (I − β2 k2 k2ᵀ) D2 S1 + β2 k2 v2ᵀ, o_t = S_tᵀ q_t·scale
    q = torch.tensor([[0.6, 0.8], [1.0, 0.0]]).view(1, 2, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[2.0, -1.0], [0.5, 3.0]]).view(1, 2, 1, 2)
    g = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.1]])).view(1, 2, 1, 2)
    beta = torch.tensor([0.5, 0.8]).view(1, 2, 1)
    o, S = naive_recurrent_kda(q, k, v, g, beta, scale=1.0)
    S1 = 0.5 * torch.outer(torch.tensor([1.0, 0.0]), torch.tensor([2.0, -1.0]))
    k2, v2 = torch.tensor([0.0, 1.0]), torch.tensor([0.5, 3.0])
    S2 = (torch.eye(2) - 0.8 * torch.outer(k2, k2)) @ torch.diag(torch.tensor([0.5, 0.1])) @ S1 \
        + 0.8 * torch.outer(k2, v2)
    torch.testing.assert_close(o[0, 0, 0], S1.T @ torch.tensor([0.6, 0.8]))
    torch.testing.assert_close(o[0, 1, 0], S2.T @ torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(S[0, 0], S2)


def test_lower_bound_gate_closed_form():
    z = torch.tensor([[[-3.0, 0.0], [2.0, 10.0]]])  # [1, heads=2, K=2]
    A_log = torch.tensor([0.0, math.log(2.0)])
    dt_bias = torch.tensor([0.5, -0.5, 1.0, 0.0])
    g = kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    for h in range(2):
        for d in range(2):
            x = math.exp(float(A_log[h])) * (float(z[0, h, d]) + float(dt_bias[h * 2 + d]))
            assert g[0, h, d].item() == pytest.approx(-5.0 / (1.0 + math.exp(-x)), rel=1e-6)
    assert g.dtype == torch.float32


def test_softplus_gate_closed_form():
    z = torch.tensor([[[-3.0, 0.0], [2.0, 30.0]]])
    A_log = torch.tensor([0.0, math.log(3.0)])
    dt_bias = torch.tensor([0.5, -0.5, 1.0, 0.0])
    g = kda_gate(z, A_log, dt_bias, lower_bound=None)
    for h in range(2):
        for d in range(2):
            x = float(z[0, h, d]) + float(dt_bias[h * 2 + d])
            assert g[0, h, d].item() == pytest.approx(-math.exp(float(A_log[h])) * math.log1p(math.exp(x)),
                                                      rel=1e-6)


def test_lower_bound_swaps_the_function_it_does_not_clamp():
    z = torch.linspace(-6, 6, 25).view(1, 1, 25)
    A_log, dt_bias = torch.zeros(1), torch.zeros(25)
    bounded = kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    softplus_form = kda_gate(z, A_log, dt_bias, lower_bound=None)
    clamped = softplus_form.clamp(min=-5.0)
    assert (bounded > -5.0).all() and (bounded < 0.0).all()
    # where the softplus form is inside (−5, 0) a clamp would leave it unchanged; the K3 gate does not
    inside = softplus_form > -5.0
    assert inside.sum() >= 10
    assert (bounded[inside] - clamped[inside]).abs().min() > 1e-3
    assert bounded[0, 0, 12].item() == pytest.approx(-2.5)  # lb · sigmoid(0)


def test_l2_normalize_matches_fla_formula():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    y = l2_normalize(x)
    torch.testing.assert_close(y[0], torch.tensor([3.0, 4.0]) / math.sqrt(25 + 1e-6))
    assert torch.equal(y[1], torch.zeros(2))


def test_matches_transformers_kimi_linear_torch_path():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, s0 = make_inputs(T=45)
    # the undecorated torch function (the decorator would look for a hub kernel first)
    reference = getattr(kimi.chunk_kimi_delta_attention, "__wrapped__", kimi.chunk_kimi_delta_attention)
    o_ref, s_ref = reference(q, k, v, g, beta, chunk_size=16, initial_state=s0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=0)


def test_matches_fla_naive_when_available():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.exists():
        pytest.skip(f"{path} not found")
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    naive = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(naive)
    q, k, v, g, beta, s0 = make_inputs(T=29)
    o_ref, s_ref = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o, o_ref.to(o.dtype), atol=ATOL, rtol=0)
    torch.testing.assert_close(s, s_ref.float(), atol=ATOL, rtol=0)


def test_kda_core_dispatch_and_errors():
    q, k, v, g, beta, s0 = make_inputs(T=1)
    o_auto, s_auto = kda_core(q, k, v, g, beta, initial_state=s0)
    o_naive, s_naive = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    assert torch.equal(o_auto, o_naive) and torch.equal(s_auto, s_naive)
    with pytest.raises(ValueError, match="expected g like q"):
        kda_core(q, k, v, g[..., :2], beta)
    with pytest.raises(ValueError, match="initial_state"):
        kda_core(q, k, v, g, beta, initial_state=s0[:, :1])
    with pytest.raises(ValueError, match="backend='nope'"):
        kda_core(q, k, v, g, beta, backend="nope")
    from k3.kernels.kda.fla import fla_available
    if not fla_available():
        with pytest.raises(RuntimeError, match="flash-linear-attention"):
            kda_core(q, k, v, g, beta, backend="fla")
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=0)


@pytest.mark.gpu
def test_fla_backend_matches_torch_on_cuda():
    from k3.kernels.kda.fla import fla_available
    if not fla_available():
        pytest.skip("flash-linear-attention with Triton is not importable")
    for T in (1, 100):
        q, k, v, g, beta, s0 = (t.cuda() for t in make_inputs(T=T, K=64, V=64))
        o_ref, s_ref = kda_core(q, k, v, g, beta, initial_state=s0, backend="torch_chunk")
        o, s = kda_core(q, k, v, g, beta, initial_state=s0, backend="fla")
        # fla's chunk kernels multiply in TF32: agreement to ~1e-3, not 1e-5
        torch.testing.assert_close(o, o_ref, atol=3e-3, rtol=0)
        torch.testing.assert_close(s, s_ref, atol=1e-2, rtol=0)


def test_chunk_gradients_match_recurrence():
    q, k, v, g, beta, s0 = make_inputs(T=21, B=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5])
    grads = torch.autograd.grad((o.sum() + s.sum()), leaves)
    leaves_ref = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
    o_r, s_r = naive_recurrent_kda(*leaves_ref[:5], initial_state=leaves_ref[5])
    grads_ref = torch.autograd.grad((o_r.sum() + s_r.sum()), leaves_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the layer


@pytest.fixture(scope="module")
def tiny_kda():
    torch.manual_seed(0)
    cfg = variant("tiny")
    model = KimiK3ForCausalLM(cfg)
    return cfg, model.model.layers[0].self_attn


def test_layer_token_by_token_equals_full(tiny_kda):
    cfg, attn = tiny_kda
    x = torch.randn(2, 9, cfg.hidden_size)
    full = attn(x)
    state = K3Cache(cfg, 2, torch.float32, "cpu").layers[0]
    steps = [attn(x[:, t:t + 1], state=state) for t in range(9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=0)
    # several tokens at a time (chunked prefill) too
    state = K3Cache(cfg, 2, torch.float32, "cpu").layers[0]
    parts = [attn(x[:, :2], state=state), attn(x[:, 2:7], state=state), attn(x[:, 7:], state=state)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)
    assert state.conv_q.shape == (2, cfg.kda_proj_size, cfg.linear_attn_config.short_conv_kernel_size - 1)


def test_layer_matches_hand_written_reference(tiny_kda):
    cfg, attn = tiny_kda
    x = torch.randn(1, 6, cfg.hidden_size)
    nh, d = cfg.num_kda_heads, cfg.kda_head_dim
    Kc = cfg.linear_attn_config.short_conv_kernel_size

    def conv_silu(proj, conv):
        p = proj(x)[0]  # [T, P]
        out = torch.zeros_like(p)
        for t in range(p.shape[0]):
            for j in range(Kc):  # weight tap j multiplies the input K-1-j steps back
                src = t - (Kc - 1 - j)
                if src >= 0:
                    out[t] += conv.weight[:, 0, j] * p[src]
        return F.silu(out).view(-1, nh, d)

    q = conv_silu(attn.q_proj, attn.q_conv1d)
    k = conv_silu(attn.k_proj, attn.k_conv1d)
    v = conv_silu(attn.v_proj, attn.v_conv1d)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    z = attn.f_b_proj(attn.f_a_proj(x))[0].view(-1, nh, d) + attn.dt_bias.view(nh, d)
    g = -5.0 * torch.sigmoid(attn.A_log.exp().view(nh, 1) * z)
    beta = torch.sigmoid(attn.b_proj(x)[0])
    S = torch.zeros(nh, d, d)
    outs = []
    for t in range(x.shape[1]):
        S = S * g[t].exp().unsqueeze(-1)
        S = S + beta[t].view(nh, 1, 1) * k[t].unsqueeze(-1) * (v[t] - torch.einsum("hkv,hk->hv", S, k[t])).unsqueeze(1)
        outs.append(torch.einsum("hkv,hk->hv", S, q[t] / math.sqrt(d)))
    o = torch.stack(outs)  # [T, nh, d]
    gate = attn.g_proj(x)[0].view(-1, nh, d)
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + cfg.rms_norm_eps) * attn.o_norm.weight * torch.sigmoid(gate)
    want = attn.o_proj(o.reshape(x.shape[1], -1))
    torch.testing.assert_close(attn(x)[0], want, atol=ATOL, rtol=0)


def test_padding_leaves_the_state_untouched(tiny_kda):
    cfg, attn = tiny_kda
    x = torch.randn(1, 7, cfg.hidden_size)
    mask = torch.tensor([[False, False, False, True, True, True, True]])
    state = K3Cache(cfg, 1, torch.float32, "cpu").layers[0]
    attn(x[:, :3], token_mask=mask[:, :3], state=state)
    assert torch.equal(state.recurrent, torch.zeros_like(state.recurrent))
    assert torch.equal(state.conv_q, torch.zeros_like(state.conv_q))
    out_padded = attn(x, token_mask=mask)
    out_alone = attn(x[:, 3:])
    torch.testing.assert_close(out_padded[:, 3:], out_alone, atol=ATOL, rtol=0)
    # a nonzero carried state is not decayed or written by a padded step either
    state = K3Cache(cfg, 1, torch.float32, "cpu").layers[0]
    attn(x[:, 3:], state=state)
    before = state.recurrent.clone()
    attn(x[:, :1], token_mask=torch.tensor([[False]]), state=state)
    assert torch.equal(state.recurrent, before)


def test_a_log_is_stored_padded_and_loaded_sliced(tiny_kda):
    cfg, attn = tiny_kda
    sd = attn.state_dict()
    assert sd["A_log"].shape == (cfg.a_log_stored_len,)
    assert torch.equal(sd["A_log"][: cfg.num_kda_heads], attn.A_log.detach())
    assert torch.equal(sd["A_log"][cfg.num_kda_heads:], torch.zeros(cfg.a_log_stored_len - cfg.num_kda_heads))
    fresh = KDAttention(cfg, 0)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.A_log, attn.A_log)
    bad = dict(sd)
    bad["A_log"] = sd["A_log"].clone()
    bad["A_log"][-1] = 1.0
    with pytest.raises(RuntimeError, match="padding past the 4 heads is not zero"):
        fresh.load_state_dict(bad)


def test_float32_parameters_survive_dtype_casts(tiny_kda):
    cfg, _ = tiny_kda
    attn = KDAttention(cfg, 0).to(torch.bfloat16)
    assert attn.q_proj.weight.dtype == torch.bfloat16
    for p in (attn.A_log, attn.dt_bias, attn.q_conv1d.weight, attn.o_norm.weight):
        assert p.dtype == torch.float32
    attn.half()
    assert attn.A_log.dtype == torch.float32 and attn.k_proj.weight.dtype == torch.float16
