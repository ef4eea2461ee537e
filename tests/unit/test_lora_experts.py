"""Shared-outer expert LoRA against a plain per-expert loop: forward, gradients, layout, batching, state dict."""

from __future__ import annotations

import math

import pytest
import torch

import k3.kernels.expert_lora.folded as folded
import k3.lora.experts as lora_experts
import k3.model.moe as moe
from k3.lora.experts import LoRALatentExperts
from k3.model.mlp import situ
from k3.model.moe import LatentExperts

E, LT, FI = 5, 16, 12


def _experts(rank=4, alpha=8.0, fc1=True, fc2=True, seed=0, num_experts=E, fused=False):
    torch.manual_seed(seed)
    base = LatentExperts(num_experts, LT, FI, beta=4.0, linear_beta=25.0)
    with torch.no_grad():
        for w in (base.w1, base.w2, base.w3):
            w.normal_(std=0.2)
    m = LoRALatentExperts(base, rank, alpha, fc1=fc1, fc2=fc2, fused=fused)
    with torch.no_grad():
        for name in m.factor_names():
            if name.endswith("_B"):
                getattr(m, name).normal_()
    return base, m


def _rows(counts):
    counts = torch.tensor(counts)
    return torch.randn(int(counts.sum()), LT), counts


def _loop_reference(m: LoRALatentExperts, x, counts):
    """gate, up, down outputs computed expert by expert with the shared-outer formulas."""
    s = m.scale
    gates, ups, downs, start = [], [], [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        g, u = xe @ m.w1[e].T, xe @ m.w3[e].T
        if m.fc1:
            g = g + s * (xe @ m.w1_lora_A.T) @ m.w1_lora_B[e].T
            u = u + s * (xe @ m.w3_lora_A.T) @ m.w3_lora_B[e].T
        h = situ(g, u, m.beta, m.linear_beta)
        d = h @ m.w2[e].T
        if m.fc2:
            d = d + s * (h @ m.w2_lora_A[e].T) @ m.w2_lora_B.T
        gates.append(g), ups.append(u), downs.append(d)
        start += n
    return torch.cat(gates), torch.cat(ups), torch.cat(downs)


@pytest.mark.parametrize("fc1, fc2", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("rank", [4, 3])  # 4: native grouped GEMM; 3: its stride rule fails -> padded path
def test_forward_matches_the_per_expert_loop(fc1, fc2, rank):
    _, m = _experts(rank=rank, fc1=fc1, fc2=fc2)
    x, counts = _rows([3, 0, 5, 1, 4])  # an expert without rows is fine
    g, u = m.gate_up(x, counts)
    rg, ru, rd = _loop_reference(m, x, counts)
    torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u, ru, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m(x, counts), rd, rtol=1e-5, atol=1e-5)


def test_gradients_match_the_per_expert_loop():
    _, m = _experts()
    x, counts = _rows([2, 4, 0, 3, 6])
    m(x, counts).square().sum().backward()
    got = {n: getattr(m, n).grad.clone() for n in m.factor_names()}
    for n in m.factor_names():
        getattr(m, n).grad = None
    _loop_reference(m, x, counts)[2].square().sum().backward()
    for n in m.factor_names():  # float32 sums in another order: tolerance relative to the gradient's size
        ref = getattr(m, n).grad
        torch.testing.assert_close(got[n], ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()), msg=n)
    assert m.w1.grad is None and m.w2.grad is None and m.w3.grad is None


@pytest.mark.parametrize("fused", [False, True])
def test_fresh_adapters_are_a_no_op(fused):
    torch.manual_seed(3)
    base = LatentExperts(E, LT, FI, 4.0, 25.0)
    with torch.no_grad():
        for w in (base.w1, base.w2, base.w3):
            w.normal_(std=0.2)
    x, counts = _rows([1, 2, 3, 4, 5])
    want = base(x, counts)
    m = LoRALatentExperts(base, rank=4, alpha=8, fused=fused)
    if fused:  # zero B's add exact zeros, but the GEMM's longer K may sum the base products in another order
        torch.testing.assert_close(m(x, counts), want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(m(x, counts), want)


def test_shared_outer_layout_and_init():
    base, m = _experts(rank=6, fc1=True, fc2=True)
    shapes = {n: tuple(getattr(m, n).shape) for n in m.factor_names()}
    assert shapes == {"w1_lora_A": (6, LT), "w3_lora_A": (6, LT), "w1_lora_B": (E, FI, 6),
                      "w3_lora_B": (E, FI, 6), "w2_lora_A": (E, 6, FI), "w2_lora_B": (LT, 6)}
    fresh = LoRALatentExperts(LatentExperts(E, LT, FI, 4.0, 25.0), rank=6, alpha=12)
    for n in ("w1_lora_B", "w3_lora_B", "w2_lora_B"):
        assert torch.count_nonzero(getattr(fresh, n)) == 0
    for n, fan_in in (("w1_lora_A", LT), ("w3_lora_A", LT), ("w2_lora_A", FI)):
        bound = math.sqrt(6 / (fan_in + 6))  # Xavier over each [r, fan_in] slice
        a = getattr(fresh, n)
        assert 0.8 * bound < a.abs().max() <= bound
    assert m.w1 is base.w1 and m.w2 is base.w2 and not m.w1.requires_grad
    assert not hasattr(base, "w1_lora_A")  # the adapters are not registered on the base module


@pytest.mark.parametrize("fused, gate_up_calls, down_calls", [(False, 4, 2), (True, 2, 1)])
def test_batched_over_experts_no_python_loop(monkeypatch, fused, gate_up_calls, down_calls):
    calls = {"n": 0}
    real = lora_experts.grouped_mm

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    for mod in (lora_experts, moe, folded):
        monkeypatch.setattr(mod, "grouped_mm", counting)
    for num_experts in (4, 32):
        _, m = _experts(num_experts=num_experts)
        m.fused = fused
        counts = torch.full((num_experts,), 2)
        x = torch.randn(2 * num_experts, LT)
        calls["n"] = 0
        m.gate_up(x, counts)
        # plain: base w1, w3 + adapter B1, B3; fused: [B1|w1] and [w3|B3]; whatever the number of experts
        assert calls["n"] == gate_up_calls
        calls["n"] = 0
        m.down(torch.randn(2 * num_experts, FI), counts)
        assert calls["n"] == down_calls


def test_delta_weights_are_the_per_expert_products():
    _, m = _experts()
    d = m.delta_weights()
    for e in range(E):
        torch.testing.assert_close(d["w1"][e], m.scale * m.w1_lora_B[e] @ m.w1_lora_A)
        torch.testing.assert_close(d["w3"][e], m.scale * m.w3_lora_B[e] @ m.w3_lora_A)
        torch.testing.assert_close(d["w2"][e], m.scale * m.w2_lora_B @ m.w2_lora_A[e])


def test_state_dict_keeps_hf_expert_names_and_round_trips():
    _, m = _experts()
    sd = m.state_dict()
    assert {f"{e}.w{k}.weight" for e in range(E) for k in (1, 2, 3)} | set(m.factor_names()) == set(sd)
    _, other = _experts(seed=9)
    other.load_state_dict(sd)
    for n in ("w1", "w2", "w3", *m.factor_names()):
        assert torch.equal(getattr(other, n), getattr(m, n)), n


def test_dropout_only_in_training():
    base, m = _experts()
    m.dropout = 0.5
    x, counts = _rows([2, 2, 2, 2, 2])
    m.eval()
    torch.testing.assert_close(m(x, counts), _loop_reference(m, x, counts)[2], rtol=1e-5, atol=1e-5)
    m.train()
    assert not torch.allclose(m(x, counts), m.eval()(x, counts))


def test_bad_construction_raises():
    base, m = _experts()
    with pytest.raises(TypeError, match="already"):
        LoRALatentExperts(m, 4, 8)
    with pytest.raises(TypeError, match="LatentExperts"):
        LoRALatentExperts(torch.nn.Linear(2, 2), 4, 8)
    with pytest.raises(ValueError, match="fc1 and/or fc2"):
        LoRALatentExperts(LatentExperts(E, LT, FI, 4.0, 25.0), 4, 8, fc1=False, fc2=False)


# ---------------------------------------------------------------------------- fused path vs plain path
def _pair(rank=4, fc1=True, fc2=True, dtype=torch.float32):
    """The same experts and adapters twice: plain (reference) and fused."""
    _, plain = _experts(rank=rank, fc1=fc1, fc2=fc2)
    plain.fused = False
    _, fused = _experts(rank=rank, fc1=fc1, fc2=fc2, fused=True)
    return plain.to(dtype), fused.to(dtype)


@pytest.mark.parametrize("fc1, fc2", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("rank", [4, 3])  # 3: odd slot widths, column slices fail the 16-byte rule -> copies
def test_fused_path_equals_plain_path_forward_and_gradients(fc1, fc2, rank):
    plain, fused = _pair(rank=rank, fc1=fc1, fc2=fc2)
    counts = torch.tensor([2, 4, 0, 3, 6])
    x = torch.randn(int(counts.sum()), LT)
    upstream = torch.randn(int(counts.sum()), LT)
    grads = {}
    for tag, m in (("plain", plain), ("fused", fused)):
        xi = x.clone().requires_grad_(True)
        out = m(xi, counts)
        names = m.factor_names()
        g = torch.autograd.grad(out, [xi] + [getattr(m, n) for n in names], upstream)
        grads[tag] = (out.detach(), dict(zip(("x",) + names, g)))
    torch.testing.assert_close(grads["fused"][0], grads["plain"][0], rtol=1e-5, atol=1e-5)
    for n, ref in grads["plain"][1].items():
        torch.testing.assert_close(grads["fused"][1][n], ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()), msg=n)


def test_fused_path_in_bf16_is_close_to_float32():
    plain, _ = _pair()
    _, fused = _pair(dtype=torch.bfloat16)
    counts = torch.tensor([3, 1, 4, 0, 5])
    x = torch.randn(int(counts.sum()), LT)
    want = plain(x, counts)
    got = fused(x.bfloat16(), counts).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_base_weights_live_in_augmented_storage_with_an_adapter_slot():
    _, m = _experts(rank=4, fused=True)
    r = 4
    aug = {n: m._augmented_storage[n] for n in ("w1", "w3", "w2")}
    assert aug["w1"].shape == (E, FI, r + LT) and aug["w3"].shape == (E, FI, LT + r)
    assert aug["w2"].shape == (E, LT + r, FI)
    assert m.w1.data_ptr() == aug["w1"][:, :, r:].data_ptr()  # [B1 | w1]
    assert m.w3.data_ptr() == aug["w3"].data_ptr() and m.w2.data_ptr() == aug["w2"].data_ptr()
    assert isinstance(m.w1, torch.nn.Parameter) and not m.w1.requires_grad
    counts = torch.tensor([1, 1, 1, 1, 1])
    m(torch.randn(5, LT), counts)  # a forward refreshes the slots from the adapters
    assert torch.equal(aug["w1"][:, :, :r], m.w1_lora_B.detach()) and torch.equal(aug["w3"][:, :, LT:], m.w3_lora_B.detach())
    assert torch.equal(aug["w2"][:, LT:, :], m.w2_lora_A.detach())
    plain = LoRALatentExperts(LatentExperts(E, LT, FI, 4.0, 25.0), rank=4, alpha=8, fused=False)
    assert plain._augmented_storage == {} and plain.w1.is_contiguous()


def test_new_base_weights_reach_the_fused_path():
    """In-place loads keep the aliasing; ``.to()`` and ``assign=True`` loads replace tensors and rebuild it."""
    plain, fused = _pair()
    counts = torch.tensor([2, 2, 2, 2, 2])
    x = torch.randn(10, LT)
    torch.manual_seed(7)
    new = {n: torch.randn_like(getattr(plain, n)) * 0.2 for n in ("w1", "w2", "w3")}
    for m in (plain, fused):
        with torch.no_grad():
            for n, t in new.items():
                getattr(m, n).copy_(t)
    torch.testing.assert_close(fused(x, counts), plain(x, counts), rtol=1e-5, atol=1e-5)
    fused = fused.to(torch.float64)
    assert fused._augmented_storage["w1"].dtype == torch.float32  # stale until the next forward
    out = fused(x.double(), counts)
    assert fused._augmented_storage["w1"].dtype == torch.float64
    assert fused.w1.data_ptr() == fused._augmented_storage["w1"][:, :, 4:].data_ptr()
    torch.testing.assert_close(out.float(), plain(x, counts), rtol=1e-4, atol=1e-4)  # float64 vs float32
    state = {k: v.clone() * 0.5 for k, v in plain.state_dict().items()}
    plain.load_state_dict(state)
    fused = fused.float()
    fused.load_state_dict(state, assign=True)
    torch.testing.assert_close(fused(x, counts), plain(x, counts), rtol=1e-5, atol=1e-5)


def test_two_forwards_before_the_backwards():
    """Micro-batches: the second forward refreshes the slots before the first backward runs."""
    plain, fused = _pair()
    counts = torch.tensor([1, 2, 3, 0, 4])
    xs = [torch.randn(10, LT) for _ in range(2)]
    for m in (plain, fused):
        outs = [m(x, counts) for x in xs]
        sum(o.square().sum() for o in outs).backward()
    for n in plain.factor_names():
        ref = getattr(plain, n).grad
        torch.testing.assert_close(getattr(fused, n).grad, ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()), msg=n)


def test_dropout_in_training_takes_the_plain_path(monkeypatch):
    _, m = _experts(fused=True)
    m.dropout = 0.1
    used = []
    monkeypatch.setattr(lora_experts, "lora_gate_up", lambda *a: used.append("gate_up"))
    monkeypatch.setattr(lora_experts, "lora_down", lambda *a: used.append("down"))
    counts = torch.tensor([2, 2, 2, 2, 2])
    m.train()(torch.randn(10, LT), counts)
    assert used == []
    with pytest.raises(TypeError):  # eval: dropout is off, so the fused path runs (here: the stub)
        m.eval()(torch.randn(10, LT), counts)
    assert used == ["gate_up"]


def test_merged_experts_run_the_base_gemms_on_the_strided_views():
    from k3.lora.merge import merge_lora, unmerge_lora

    base, m = _experts(fused=True)
    counts = torch.tensor([2, 1, 0, 3, 4])
    x = torch.randn(10, LT)
    want = m(x, counts)
    merge_lora(m)
    torch.testing.assert_close(m(x, counts), want, rtol=1e-4, atol=1e-4)
    unmerge_lora(m)
    torch.testing.assert_close(m(x, counts), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("multiple, shared", [(1, False), (8, True), (8, False), (32, True)])
def test_fused_layouts_with_padded_slots_equal_the_plain_path(multiple, shared):
    plain, fused = _pair(rank=4)
    fused.slot_multiple, fused.shared_input = multiple, shared
    counts = torch.tensor([2, 4, 0, 3, 6])
    x = torch.randn(15, LT)
    up = torch.randn(15, LT)
    res = {}
    for tag, m in (("plain", plain), ("fused", fused)):
        xi = x.clone().requires_grad_(True)
        out = m(xi, counts)
        res[tag] = [out.detach(), *torch.autograd.grad(out, [xi] + [getattr(m, n) for n in m.factor_names()], up)]
    slot = {"w1": fused._augmented_storage["w1"].shape[2] - LT, "w2": fused._augmented_storage["w2"].shape[1] - LT}
    assert all(w >= 4 and (LT + w) % multiple == 0 for w in slot.values())
    assert torch.count_nonzero(fused._augmented_storage["w1"][:, :, 4:slot["w1"]]) == 0  # the padding stays zero
    for a, b in zip(res["fused"], res["plain"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()))


def test_slot_width():
    from k3.kernels.expert_lora.folded import slot_width

    assert slot_width(3584, 32) == 32 and slot_width(3584, 32, 64) == 64 and slot_width(3584, 32, 128) == 128
    assert slot_width(3072, 32, 256) == 256 and slot_width(16, 4, 8) == 8
    with pytest.raises(ValueError, match="rank=0"):
        slot_width(16, 0)
