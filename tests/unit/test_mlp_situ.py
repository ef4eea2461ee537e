"""SiTU-GLU: bounded, finite, the formula; the dense/shared MLP built on it."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.model.mlp import DenseMLP, SharedExperts, situ

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


def situ_formula(g: float, u: float, b1: float = 4.0, b2: float = 25.0) -> float:
    sig = 1.0 / (1.0 + math.exp(-g)) if g >= 0 else math.exp(g) / (1.0 + math.exp(g))
    return b1 * math.tanh(g / b1) * sig * b2 * math.tanh(u / b2)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(finite32, finite32), min_size=1, max_size=16))
def test_situ_is_bounded_finite_and_matches_the_formula(pairs):
    g = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    u = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    out = situ(g, u)
    assert torch.isfinite(out).all()
    assert (out.abs() <= 100.0).all()
    for (gv, uv), o in zip(pairs, out.tolist()):
        assert math.isclose(o, situ_formula(gv, uv), rel_tol=1e-5, abs_tol=1e-6)


@settings(max_examples=100, deadline=None)
@given(finite32, finite32)
def test_situ_in_bfloat16_is_computed_in_float32(gv, uv):
    g = torch.tensor([gv], dtype=torch.bfloat16)
    u = torch.tensor([uv], dtype=torch.bfloat16)
    out = situ(g, u)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, situ(g.float(), u.float()).to(torch.bfloat16))


def test_situ_saturates_at_beta1_times_beta2():
    big = torch.tensor([1e6, 1e30, -1e30])
    out = situ(big, torch.tensor([1e6, 1e30, 1e30]))
    assert out.tolist()[:2] == [100.0, 100.0]
    assert out[2].item() == 0.0  # sigmoid(−∞) kills the gate
    # soft clip, not a hard one: inside the range SiTU differs from min(max(g·σ(g), −4), 4)·u
    g, u = torch.tensor([3.0]), torch.tensor([10.0])
    hard = (g * torch.sigmoid(g)).clamp(-4, 4) * u.clamp(-25, 25)
    assert (situ(g, u) - hard).abs().item() > 1.0


def test_dense_mlp_is_down_of_situ_of_gate_and_up():
    torch.manual_seed(0)
    mlp = DenseMLP(8, 12, 4.0, 25.0)
    x = torch.randn(3, 8)
    want = mlp.down_proj.weight @ situ(mlp.gate_proj.weight @ x.T, mlp.up_proj.weight @ x.T)
    torch.testing.assert_close(mlp(x), want.T)
    assert isinstance(SharedExperts(8, 12, 4.0, 25.0), DenseMLP)
    assert {n for n, _ in mlp.named_parameters()} == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
