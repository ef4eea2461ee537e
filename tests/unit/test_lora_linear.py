"""LoRALinear against the closed form ``x Wᵀ + (alpha/r) (x Aᵀ) Bᵀ``: init, dropout, freezing, tied A."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from k3.lora.linear import LoRALinear, new_lora_A


def _lora(in_f=24, out_f=40, rank=4, alpha=8.0, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    base = nn.Linear(in_f, out_f, bias=False)
    m = LoRALinear(base, rank, alpha, dropout)
    with torch.no_grad():
        m.lora_B.normal_()
    return base, m


def test_forward_matches_the_closed_form():
    base, m = _lora()
    x = torch.randn(3, 5, 24)
    want = x @ base.weight.T + 2.0 * (x @ m.lora_A.T) @ m.lora_B.T
    torch.testing.assert_close(m(x), want, rtol=1e-6, atol=1e-6)


def test_fresh_adapter_is_an_exact_no_op_and_init_is_xavier():
    torch.manual_seed(1)
    base = nn.Linear(256, 64, bias=False)
    m = LoRALinear(base, rank=16, alpha=32)
    x = torch.randn(7, 256)
    assert torch.equal(m(x), base(x))
    assert torch.count_nonzero(m.lora_B) == 0
    bound = math.sqrt(6 / (256 + 16))
    assert m.lora_A.abs().max() <= bound
    assert m.lora_A.abs().max() > 0.9 * bound  # uniform over the whole range, not a narrower init
    assert m.lora_A.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def test_base_weight_is_reused_frozen_and_keeps_its_name():
    base, m = _lora()
    assert m.weight is base.weight and not m.weight.requires_grad
    assert set(m.state_dict()) == {"weight", "lora_A", "lora_B"}
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]


def test_gradients_reach_only_the_adapter():
    base, m = _lora()
    x = torch.randn(6, 24)
    m(x).square().sum().backward()
    assert m.weight.grad is None
    A, B = m.lora_A.detach().requires_grad_(), m.lora_B.detach().requires_grad_()
    (x @ base.weight.T + 2.0 * (x @ A.T) @ B.T).square().sum().backward()
    torch.testing.assert_close(m.lora_A.grad, A.grad)
    torch.testing.assert_close(m.lora_B.grad, B.grad)


def test_dropout_hits_the_adapter_input_in_training_only():
    base, m = _lora(dropout=0.5)
    x = torch.randn(64, 24)
    m.eval()
    torch.testing.assert_close(m(x), x @ base.weight.T + 2.0 * (x @ m.lora_A.T) @ m.lora_B.T)
    m.train()
    torch.manual_seed(5)
    got = m(x)
    torch.manual_seed(5)
    dropped = torch.nn.functional.dropout(x, 0.5, True)
    torch.testing.assert_close(got, x @ base.weight.T + 2.0 * (dropped @ m.lora_A.T) @ m.lora_B.T)
    assert not torch.allclose(got, m.eval()(x))


def test_tied_A_sums_both_gradients():
    torch.manual_seed(2)
    gate, up = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)
    A = new_lora_A(4, 16, like=gate.weight)
    g, u = LoRALinear(gate, 4, 4, shared_A=A), LoRALinear(up, 4, 4, shared_A=A)
    with torch.no_grad():
        g.lora_B.normal_()
        u.lora_B.normal_()
    assert g.lora_A is u.lora_A
    x = torch.randn(5, 16)
    (g(x) * u(x)).sum().backward()
    a = A.detach().clone().requires_grad_()
    gy = x @ gate.weight.T + (x @ a.T) @ g.lora_B.detach().T
    uy = x @ up.weight.T + (x @ a.T) @ u.lora_B.detach().T
    (gy * uy).sum().backward()
    torch.testing.assert_close(A.grad, a.grad)


def test_adapters_follow_the_base_dtype_and_device():
    base = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    m = LoRALinear(base, 2, 4)
    assert m.lora_A.dtype == m.lora_B.dtype == torch.bfloat16
    with torch.device("meta"):
        meta = LoRALinear(nn.Linear(8, 8, bias=False), 2, 4)
    assert meta.lora_A.is_meta and meta.lora_B.is_meta


def test_delta_weight_is_the_closed_form_in_float32():
    base, m = _lora()
    torch.testing.assert_close(m.delta_weight(), 2.0 * m.lora_B @ m.lora_A)
    assert m.delta_weight().dtype == torch.float32


def test_bad_bases_raise():
    with pytest.raises(ValueError, match="bias"):
        LoRALinear(nn.Linear(4, 4, bias=True), 2, 4)
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Conv1d(4, 4, 1), 2, 4)
    _, m = _lora()
    with pytest.raises(TypeError, match="already"):
        LoRALinear(m, 2, 4)
    with pytest.raises(ValueError, match=r"shared lora_A has shape \(2, 5\): expected \(2, 4\)"):
        LoRALinear(nn.Linear(4, 4, bias=False), 2, 4, shared_A=nn.Parameter(torch.zeros(2, 5)))
