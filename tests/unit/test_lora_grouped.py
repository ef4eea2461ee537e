"""Rank-r grouped Triton kernels for expert-sorted rows (``k3/kernels/expert_lora/``) against their torch
references, and ``LoRALatentExperts(lora_impl="triton")`` against the plain torch path.

Where they run: the kernel tests need Triton and run on the CPU under ``TRITON_INTERPRET=1`` (set before the
import), e.g. in a side venv with triton 3.6 and numpy < 2.4 (triton-lang/triton#9171: Triton 3.6's interpreter
fails on numpy 2.4's scalar conversion); they are skipped with the reason where Triton is missing (CI's venv) or
the interpreter is off. The ``gpu`` tests run the compiled kernels on CUDA. The schedule, the argument checks and
the module's dispatch (default path unchanged, the ValueError when Triton cannot run) need no Triton.

Tolerances. fp32 (interpreter: numpy fp32 products; CUDA: IEEE fp32 ``tl.dot``) vs the fp32 torch references:
they differ only in summation order, so outputs within 1e-5 relative + 1e-5 absolute (values O(1), sums of at
most ~100 products), gradients within 1e-5 relative to each gradient's largest entry. bf16 kernels vs an fp32
reference on the same bf16-rounded inputs: one bf16 rounding of the output (2^-9 relative), so 5e-3 relative
Frobenius error; the whole module in bf16 vs the fp32 CPU path: 2e-2 (bf16 activations between the GEMMs, as
``test_gpu_expert_lora.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from k3.kernels import availability
from k3.kernels.expert_lora import function
from k3.kernels.expert_lora.reference import (contract_reference, expand_add_reference, tile_schedule_reference,
                                              weight_grad_reference)
from k3.kernels.expert_lora.schedule import row_offsets, row_tiles, tile_schedule
from k3.kernels.expert_lora.triton import DEFAULT_BLOCKS, contract, cpu_interpreter_problem, expand_add_, weight_grad
import k3.lora.experts as lora_experts
from k3.lora.experts import LoRALatentExperts
from k3.model.moe import LatentExperts

HAS_CUDA = torch.cuda.is_available()
RTOL = ATOL = 1e-5
GRAD_REL = 1e-5
REL_BF16_KERNEL = 5e-3
REL_BF16_MODULE = 2e-2
COUNTS = [0, 1, 37, 16, 5, 0, 2]  # experts with 0 and 1 rows, several 16-row tiles, 61 rows (not a tile multiple)


_PROBLEM = cpu_interpreter_problem()
needs_interpreter = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")
needs_cuda_triton = pytest.mark.skipif(not (HAS_CUDA and availability.triton_available()
                                             and not availability.INTERPRETING),
                                       reason="needs a CUDA device and Triton (compiled, TRITON_INTERPRET unset)")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _problem(counts=COUNTS, N=40, r=5, K=70, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    c = torch.tensor(counts)
    rows, E = int(c.sum()), len(counts)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return {"counts": c, "out": rnd(rows, N), "xa": rnd(rows, r), "B": rnd(E, N, r), "h": rnd(rows, K),
            "A": rnd(E, r, K)}


# ------------------------------------------------------------------------------------------------ no Triton needed
def test_tile_schedule_covers_every_row_once_in_expert_order():
    counts = torch.tensor(COUNTS)
    sched = tile_schedule(counts, 61, 16)
    assert sched.dtype == torch.int32 and sched.shape == (3, -(-61 // 16) + len(COUNTS))
    expert, start, end = sched.tolist()
    live = [i for i, e in enumerate(expert) if e >= 0]
    assert live == list(range(len(live))) and all(e == -1 for e in expert[len(live):])  # real tiles first
    # expert 2: 37 rows from row 1 in tiles of 16, 16, 5; experts with no rows get no tile
    assert [(expert[i], start[i], end[i]) for i in live] == [
        (1, 0, 1), (2, 1, 17), (2, 17, 33), (2, 33, 38), (3, 38, 54), (4, 54, 59), (6, 59, 61)]
    exact = tile_schedule(torch.tensor([32, 16]), 48, 16)  # rows a tile multiple: no partial tiles
    assert [t for t in zip(*exact.tolist()) if t[0] >= 0] == [(0, 0, 16), (0, 16, 32), (1, 32, 48)]
    assert (tile_schedule(torch.tensor([0, 0]), 0, 16)[0] == -1).all()


@pytest.mark.parametrize("call, match", [
    (lambda p: expand_add_(p["out"], p["xa"], p["B"][:, :-1], p["counts"]), "expected out \\[rows, N\\]"),
    (lambda p: expand_add_(p["out"][:-1], p["xa"], p["B"], p["counts"]), "expected out \\[rows, N\\]"),
    (lambda p: expand_add_(p["out"], p["xa"], p["B"], p["counts"][:-1]), "counts \\(6,\\)"),
    (lambda p: expand_add_(p["out"], p["xa"], p["B"], p["counts"] * 2), "counts sum to 122"),
    (lambda p: expand_add_(p["out"], p["xa"], p["B"], p["counts"].float()), "integer"),
    (lambda p: expand_add_(p["out"], p["xa"].double(), p["B"], p["counts"]), "expected one dtype"),
    (lambda p: expand_add_(p["out"].double(), p["xa"].double(), p["B"].double(), p["counts"]),
     "expected float32, bfloat16 or float16"),
    (lambda p: contract(p["h"], p["A"][:, :, :-1], p["counts"]), "expected h \\[rows, K\\], A \\[E, r, K\\]"),
    (lambda p: contract(p["h"], p["A"], p["counts"], out=p["xa"][:, :2]), "expected \\[rows, r\\] = \\[61, 5\\]"),
    (lambda p: contract(p["h"], p["A"].bfloat16(), p["counts"]), "expected one dtype"),
    (lambda p: contract(p["h"], torch.zeros(7, 300, 70), p["counts"]), "rank 300"),
    (lambda p: weight_grad(p["out"], p["xa"][:-1], p["counts"]), "with the same rows"),
    (lambda p: weight_grad(p["out"], p["xa"], torch.tensor([62, -1, 0, 0, 0, 0, 0])), "min -1"),
])
def test_bad_inputs_raise_before_any_kernel(call, match):
    with pytest.raises(ValueError, match=match):
        call(_problem())


@pytest.mark.skipif(availability.triton_available() and availability.INTERPRETING,
                    reason="the kernels can run here (tested below)")
def test_a_valid_call_where_the_kernels_cannot_run_says_why():
    p = _problem()
    counts = torch.tensor([60, 1, 0, 0, 0, 0, 0])
    with pytest.raises((RuntimeError, ValueError), match="needs Triton|TRITON_INTERPRET=1"):
        weight_grad(p["out"], p["xa"], counts)


def _experts(rank=4, fc1=True, fc2=True, lora_impl="torch", seed=0, E=len(COUNTS), LT=16, FI=12):
    torch.manual_seed(seed)
    base = LatentExperts(E, LT, FI, beta=4.0, linear_beta=25.0)
    with torch.no_grad():
        for w in (base.w1, base.w2, base.w3):
            w.normal_(std=0.2)
    m = LoRALatentExperts(base, rank, alpha=2.0 * rank, fc1=fc1, fc2=fc2, lora_impl=lora_impl)
    with torch.no_grad():
        for name in m.factor_names():
            if name.endswith("_B"):
                getattr(m, name).normal_()
    return m


def test_default_path_is_the_torch_one_and_never_calls_the_kernels(monkeypatch):
    m = _experts()
    assert m.lora_impl == "torch" and "lora_impl=torch" in repr(m)

    def boom(*a, **k):
        raise AssertionError("the default path called a Triton wrapper")

    monkeypatch.setattr(lora_experts.expert_lora, "lora_gate_up", boom)
    monkeypatch.setattr(lora_experts.expert_lora, "lora_down", boom)
    counts = torch.tensor(COUNTS)
    x = torch.randn(int(counts.sum()), 16)
    out = m(x, counts)
    g, u = m.gate_up(x, counts)  # the plain math, written out
    s = m.scale
    xa = x @ torch.cat([m.w1_lora_A, m.w3_lora_A]).T * s
    from k3.kernels.grouped_mm import grouped_mm_reference as ref
    torch.testing.assert_close(g, ref(x, m.w1, counts) + ref(xa[:, :4], m.w1_lora_B, counts), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(u, ref(x, m.w3, counts) + ref(xa[:, 4:], m.w3_lora_B, counts), rtol=RTOL, atol=ATOL)
    assert out.shape == x.shape


def test_triton_requested_without_triton_raises_naming_the_torch_path(monkeypatch):
    monkeypatch.setattr(availability, "triton", None)
    with pytest.raises(ValueError, match="needs Triton.*use lora_impl='torch'"):
        _experts(lora_impl="triton")
    with pytest.raises(ValueError, match="lora_impl='cuda': expected one of"):
        _experts(lora_impl="cuda")
    m = _experts()
    m.lora_impl = "triton"  # set after construction: checked at the forward
    counts = torch.tensor(COUNTS)
    with pytest.raises(ValueError, match="needs Triton.*use lora_impl='torch'"):
        m(torch.randn(61, 16), counts)


def test_triton_where_it_cannot_run_raises_and_fused_is_exclusive(monkeypatch):
    monkeypatch.setattr(availability, "triton_available", lambda: True)
    monkeypatch.setattr(availability, "triton_runs_on", lambda device: False)
    m = _experts(lora_impl="triton")
    with pytest.raises(ValueError, match="cannot run on cpu.*TRITON_INTERPRET=1.*use lora_impl='torch'"):
        m(torch.randn(61, 16), torch.tensor(COUNTS))
    with pytest.raises(ValueError, match="cannot be combined with fused=True"):
        LoRALatentExperts(LatentExperts(3, 16, 12, 4.0, 25.0), 4, 8, fused=True, lora_impl="triton")
    m.lora_impl, m.fused = "triton", True  # both set after construction: refused at the forward, not ignored
    with pytest.raises(ValueError, match="cannot be combined with fused=True"):
        m(torch.randn(61, 16), torch.tensor(COUNTS))


def test_auto_takes_the_kernels_where_they_run_and_the_torch_path_elsewhere(monkeypatch):
    calls = []
    monkeypatch.setattr(lora_experts.expert_lora, "lora_gate_up", lambda *a, **k: calls.append("gate_up"))
    monkeypatch.setattr(availability, "triton_available", lambda: True)
    monkeypatch.setattr(availability, "triton_runs_on", lambda device: False)
    m = _experts(lora_impl="auto")
    counts = torch.tensor(COUNTS)
    x = torch.randn(61, 16)
    want = _experts()(x, counts)  # the same seeded weights on the torch path
    torch.testing.assert_close(m(x, counts), want)  # no error where the kernels cannot run: torch
    assert calls == [] and not function.kernels_run("auto", "cpu", False)
    monkeypatch.setattr(availability, "triton_runs_on", lambda device: True)
    assert function.kernels_run("auto", "cpu", False)
    assert not function.kernels_run("auto", "cpu", True)  # dropout: torch
    with pytest.raises(TypeError):  # the stand-in returned None: the kernels were taken
        m(x, counts)
    assert calls == ["gate_up"]
    m.fused = True  # asked for explicitly: auto defers to the fused path, where triton would refuse
    calls.clear()
    m(x, counts)
    assert calls == []


def test_dropout_in_training_keeps_the_torch_path(monkeypatch):
    monkeypatch.setattr(availability, "triton_available", lambda: True)
    monkeypatch.setattr(availability, "triton_runs_on", lambda device: True)
    used = []
    monkeypatch.setattr(function, "lora_gate_up", lambda *a: used.append("gate_up") or (a[0] @ a[4][0].T,) * 2)
    monkeypatch.setattr(function, "lora_down", lambda *a: used.append("down") or a[0] @ a[3][0].T)
    m = _experts(lora_impl="triton")
    m.dropout = 0.3
    counts = torch.tensor(COUNTS)
    m.train()(torch.randn(61, 16), counts)
    assert used == []
    m.eval()(torch.randn(61, 16), counts)  # dropout off in eval: the Triton path (here the stubs)
    assert used == ["gate_up", "down"]


# ------------------------------------------------------------------------------------------------ kernels, interpreter
@needs_interpreter
@pytest.mark.parametrize("r", [5, 16])
def test_expand_add_matches_the_reference(r):
    p = _problem(r=r)
    want = expand_add_reference(p["out"], p["xa"], p["B"], p["counts"])
    got = p["out"].clone()
    assert expand_add_(got, p["xa"], p["B"], p["counts"], block_m=16, block_n=16) is got
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # strided operands: xa a column slice, B the transpose of an [E, r, N] factor, out a column slice
    wide = torch.randn(61, 2 * r)
    Bt = p["B"].transpose(1, 2).contiguous().transpose(1, 2)
    buf = torch.zeros(61, 50)
    buf[:, 5:45] = p["out"]
    expand_add_(buf[:, 5:45], wide[:, r:], Bt, p["counts"], block_m=32, block_n=32)
    torch.testing.assert_close(buf[:, 5:45], expand_add_reference(p["out"], wide[:, r:], p["B"], p["counts"]),
                               rtol=RTOL, atol=ATOL)
    assert torch.count_nonzero(buf[:, :5]) == 0 and torch.count_nonzero(buf[:, 45:]) == 0


@needs_interpreter
def test_contract_matches_the_reference_with_scale_out_slice_and_transposed_factor():
    p = _problem()
    want = contract_reference(p["h"], p["A"], p["counts"], 0.5)
    torch.testing.assert_close(contract(p["h"], p["A"], p["counts"], 0.5, block_m=16, block_k=32), want,
                               rtol=RTOL, atol=ATOL)
    dxa = torch.full((61, 10), 7.0)
    At = p["A"].transpose(1, 2).contiguous().transpose(1, 2)  # the layout of B.transpose(1, 2) in backward
    contract(p["h"], At, p["counts"], 0.5, out=dxa[:, 5:])
    torch.testing.assert_close(dxa[:, 5:], want, rtol=RTOL, atol=ATOL)
    assert (dxa[:, :5] == 7.0).all()


@needs_interpreter
@pytest.mark.parametrize("wide_first", [True, False])  # dB = g^T xa ([E, N, r]) and dA = dha^T h ([E, r, K])
def test_weight_grad_matches_the_reference(wide_first):
    p = _problem()
    a, b = (p["out"], p["xa"]) if wide_first else (p["xa"], p["h"])
    want = weight_grad_reference(a, b, p["counts"])
    got = weight_grad(a, b, p["counts"], block_m=16, block_wide=32)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert torch.count_nonzero(got[0]) == 0 and torch.count_nonzero(got[5]) == 0  # experts without rows


@needs_interpreter
@pytest.mark.parametrize("experts, block_m", [(112, 16), (112, 64), (896, 64)])
def test_schedule_kernel_equals_the_torch_reference_exactly(experts, block_m):
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 90, (experts,), generator=gen)  # 112 (K3's EP8 share) and 896 (EP1): not powers of 2
    counts[::7] = 0  # experts without rows
    rows = int(counts.sum())
    sched, offsets = row_tiles(counts, rows, block_m)  # many programs; 896 experts: 2 tiles per program
    assert sched.shape[1] > 128
    assert torch.equal(sched, tile_schedule_reference(counts, rows, block_m))
    assert torch.equal(offsets, row_offsets(counts))
    empty, off0 = row_tiles(torch.zeros(5, dtype=torch.int64), 0, block_m)
    assert torch.equal(empty, tile_schedule_reference(torch.zeros(5, dtype=torch.int64), 0, block_m))
    assert off0.tolist() == [0] * 6
    with pytest.raises(ValueError, match="offsets .*expected \\[E \\+ 1\\]"):
        weight_grad(torch.ones(rows, 4), torch.ones(rows, 4), counts, offsets=offsets[:-1])


@needs_interpreter
def test_a_pair_of_calls_in_one_launch_equals_the_two_calls():
    p, q = _problem(seed=0), _problem(seed=1)
    c = p["counts"]
    outs = (p["out"].clone(), q["out"].clone())
    assert expand_add_(outs, (p["xa"], q["xa"]), (p["B"], q["B"]), c, block_m=16, block_n=16) is outs
    for got, o in zip(outs, (p, q), strict=True):
        torch.testing.assert_close(got, expand_add_reference(o["out"], o["xa"], o["B"], c), rtol=RTOL, atol=ATOL)
    dxa = torch.zeros(61, 10)  # the pair writes the two column halves of one tensor, as the backward does
    contract((p["h"], q["h"]), (p["A"], q["A"]), c, 0.5, out=(dxa[:, :5], dxa[:, 5:]), block_m=16, block_k=32)
    for half, o in zip((dxa[:, :5], dxa[:, 5:]), (p, q), strict=True):
        torch.testing.assert_close(half, contract_reference(o["h"], o["A"], c, 0.5), rtol=RTOL, atol=ATOL)
    dB = weight_grad((p["out"], q["out"]), (p["xa"], q["xa"]), c, block_m=16, block_wide=32)
    assert isinstance(dB, tuple) and len(dB) == 2
    for got, o in zip(dB, (p, q), strict=True):
        torch.testing.assert_close(got, weight_grad_reference(o["out"], o["xa"], c), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("call, match", [
    (lambda p: expand_add_((p["out"], p["out"]), p["xa"], (p["B"], p["B"]), p["counts"]),
     "give each a tensor \\(one call\\) or each a pair"),
    (lambda p: expand_add_((p["out"], p["out"][:, :-1]), (p["xa"],) * 2, (p["B"],) * 2, p["counts"]),
     "out pair .*a pair needs one shape, strides"),
    (lambda p: weight_grad((p["out"], p["out"].T.contiguous().T), (p["xa"],) * 2, p["counts"]),
     "a pair needs one shape, strides"),
    (lambda p: contract((p["h"], p["h"]), (p["A"], p["A"]), p["counts"]), "writes into a given pair of outputs"),
    (lambda p: function.lora_down(p["h"], p["A"], torch.ones(8, 5), torch.ones(7, 8, 70), p["counts"], 1.0,
                                  tiles=function.RowTiles(p["counts"], 60)), "tiles built for 60 rows"),
])
def test_bad_pairs_and_tiles_raise_before_any_kernel(call, match):
    with pytest.raises(ValueError, match=match):
        call(_problem())


@needs_interpreter
def test_default_blocks_and_a_single_expert():
    p = _problem(counts=[61])
    got = expand_add_(p["out"].clone(), p["xa"], p["B"], p["counts"])
    torch.testing.assert_close(got, expand_add_reference(p["out"], p["xa"], p["B"], p["counts"]),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(contract(p["h"], p["A"], p["counts"]),
                               contract_reference(p["h"], p["A"], p["counts"]), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="block_n=48: expected a power of two"):
        expand_add_(p["out"], p["xa"], p["B"], p["counts"], block_n=48)
    with pytest.raises(ValueError, match="schedule .*expected tile_schedule"):
        expand_add_(p["out"], p["xa"], p["B"], p["counts"], block_m=16,
                    schedule=tile_schedule(p["counts"], 61, 32))


@needs_interpreter
def test_bf16_under_the_interpreter_is_close_to_float32():
    """The interpreter's bf16 tl.dot multiplies bit patterns; the kernels upcast there. Checked here."""
    p = _problem(dtype=torch.bfloat16)
    f = {k: v.float() if v.is_floating_point() else v for k, v in p.items()}
    got = expand_add_(p["out"].clone(), p["xa"], p["B"], p["counts"], block_m=16, block_n=16)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, expand_add_reference(f["out"], f["xa"], f["B"], f["counts"])) <= REL_BF16_KERNEL
    assert rel_err(contract(p["h"], p["A"], p["counts"]), contract_reference(f["h"], f["A"], f["counts"])) \
        <= REL_BF16_KERNEL
    assert rel_err(weight_grad(p["out"], p["xa"], p["counts"]),
                   weight_grad_reference(f["out"], f["xa"], f["counts"])) <= REL_BF16_KERNEL


# ------------------------------------------------------------------------------------------------ module, interpreter
def _forward_backward(m, x, counts, dy):
    x = x.detach().clone().requires_grad_()
    out = m(x, counts)
    names = m.factor_names()
    grads = torch.autograd.grad(out, [x] + [getattr(m, n) for n in names], dy)
    return out.detach(), dict(zip(("x",) + names, grads))


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=ATOL)
    for n, ref in want[1].items():
        torch.testing.assert_close(got[1][n], ref, rtol=GRAD_REL, atol=GRAD_REL * float(ref.abs().max()), msg=n)


@needs_interpreter
@pytest.mark.parametrize("fc1, fc2, rank", [(True, True, 4), (True, False, 3), (False, True, 3)])
def test_triton_module_equals_the_torch_path_forward_and_every_gradient(monkeypatch, fc1, fc2, rank):
    for kernel in ("expand", "contract", "weight_grad"):  # small tiles: several per expert, partial ones
        monkeypatch.setitem(DEFAULT_BLOCKS[kernel], "block_m", 16)
    plain = _experts(rank=rank, fc1=fc1, fc2=fc2)
    fast = copy.deepcopy(plain)
    fast.lora_impl = "triton"
    counts = torch.tensor(COUNTS)
    x, dy = torch.randn(61, 16), torch.randn(61, 16)
    calls = []
    for name in ("expand_add_", "contract", "weight_grad"):
        real = getattr(function, name)
        monkeypatch.setattr(function, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    got = _forward_backward(fast, x, counts, dy)
    assert set(calls) == {"expand_add_", "contract", "weight_grad"}  # the kernels ran, not the torch path
    _assert_same(got, _forward_backward(plain, x, counts, dy))
    assert fast.w1.grad is None and fast.w2.grad is None and fast.w3.grad is None


@needs_interpreter
def test_triton_module_gradients_without_input_grad_and_with_a_stride_0_upstream():
    plain = _experts()
    fast = copy.deepcopy(plain)
    fast.lora_impl = "triton"
    counts = torch.tensor(COUNTS)
    x = torch.randn(61, 16)  # no grad wanted for x: only the factors' gradients are computed
    for m in (plain, fast):
        m(x, counts).sum().backward()  # sum() sends an expanded (stride-0) gradient
    for n in plain.factor_names():
        ref = getattr(plain, n).grad
        torch.testing.assert_close(getattr(fast, n).grad, ref, rtol=GRAD_REL, atol=GRAD_REL * float(ref.abs().max()),
                                   msg=n)


@needs_interpreter
def test_lora_functions_check_their_inputs():
    m = _experts()
    counts = torch.tensor(COUNTS)
    x = torch.randn(61, 16)
    A = torch.cat([m.w1_lora_A, m.w3_lora_A])
    with pytest.raises(ValueError, match="expected A \\[2r, Lt\\]"):
        function.lora_gate_up(x, A[:-1], m.w1_lora_B, m.w3_lora_B, m.w1, m.w3, counts, 2.0)
    with pytest.raises(ValueError, match="expected one dtype"):
        function.lora_gate_up(x.double(), A, m.w1_lora_B, m.w3_lora_B, m.w1, m.w3, counts, 2.0)
    with pytest.raises(ValueError, match="counts sum to 60"):
        function.lora_down(torch.randn(61, 12), m.w2_lora_A, m.w2_lora_B, m.w2, counts - torch.eye(7)[2].long(), 2.0)
    with pytest.raises(ValueError, match="expected A2 \\[E, r, F\\], B2 \\[Lt, r\\]"):
        function.lora_down(torch.randn(61, 12), m.w2_lora_A, m.w2_lora_B[:, :3], m.w2, counts, 2.0)


@needs_interpreter
def test_lora_fc1_on_megatrons_stacked_weight_equals_the_plain_math_forward_and_gradients(monkeypatch):
    """Megatron's fc1 weight is ``[E, 2F, Lt]`` (gate rows, then up rows) with one ``[rows, 2F]`` output: the
    kernels add into its two halves as column views, the base runs as one grouped GEMM each way."""
    from k3.kernels.grouped_mm import grouped_mm_reference as ref

    for kernel in ("expand", "contract", "weight_grad"):
        monkeypatch.setitem(DEFAULT_BLOCKS[kernel], "block_m", 16)
    m, r, s = _experts(rank=3), 3, 1.5
    counts = torch.tensor(COUNTS)
    w13 = torch.cat([m.w1, m.w3], dim=1).detach()  # [E, 2F, Lt]
    leaves = [t.detach().clone().requires_grad_() for t in
              (torch.randn(61, 16), torch.cat([m.w1_lora_A, m.w3_lora_A]), m.w1_lora_B, m.w3_lora_B)]
    x, A, B1, B3 = leaves
    dy = torch.randn(61, 24)

    got = function.lora_fc1(x, A, B1, B3, w13, counts, s)
    got_grads = torch.autograd.grad(got, leaves, dy)
    xa = s * x @ A.T
    want = torch.cat([ref(x, m.w1.detach(), counts) + ref(xa[:, :r], B1, counts),
                      ref(x, m.w3.detach(), counts) + ref(xa[:, r:], B3, counts)], dim=-1)
    want_grads = torch.autograd.grad(want, leaves, dy, retain_graph=True)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for name, g, w in zip(("x", "A", "B1", "B3"), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=GRAD_REL, atol=GRAD_REL * float(w.abs().max()), msg=name)
    function.lora_fc1(x, A, B1, B3, w13, counts, s).sum().backward()  # a stride-0 upstream gradient is taken too
    torch.testing.assert_close(B1.grad, torch.autograd.grad(want.sum(), B1)[0], rtol=GRAD_REL, atol=1e-4)
    with pytest.raises(ValueError, match="w13 \\[E, 2F, Lt\\]"):
        function.lora_fc1(x, A, B1, B3, w13[:, :-1], counts, s)


def test_apply_lora_takes_the_expert_kernel_and_an_unknown_one_changes_nothing(monkeypatch):
    from k3.config import variant
    from k3.lora import LoRAConfig, apply_lora
    from k3.model import KimiK3ForCausalLM

    model = KimiK3ForCausalLM(variant("tiny"))
    with pytest.raises(ValueError, match="expert_lora_kernel='cuda': expected one of \\('auto', 'torch', 'triton'\\)"):
        apply_lora(model, LoRAConfig(rank=2, alpha=4), expert_lora_kernel="cuda")
    assert all(p.requires_grad for p in model.parameters())  # refused before the model was touched
    monkeypatch.setattr(availability, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="expert_lora_kernel='triton' needs Triton.*use expert_lora_kernel='torch'"):
        apply_lora(model, LoRAConfig(rank=2, alpha=4), expert_lora_kernel="triton")
    monkeypatch.setattr(availability, "triton_available", lambda: True)
    apply_lora(model, LoRAConfig(rank=2, alpha=4), expert_lora_kernel="triton")
    experts = [e for e in model.modules() if isinstance(e, LoRALatentExperts)]
    cfg = variant("tiny")
    assert len(experts) == sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) > 0
    assert {e.lora_impl for e in experts} == {"triton"}


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@needs_cuda_triton
def test_cuda_float32_kernels_match_the_cpu_references_without_a_host_sync():
    p = _problem(counts=[0, 1, 130, 64, 5, 0, 200], N=300, r=32, K=200)
    c = {k: v.cuda() for k, v in p.items()}

    def run():
        return (expand_add_(c["out"].clone(), c["xa"], c["B"], c["counts"]),
                contract(c["h"], c["A"], c["counts"], 0.25), weight_grad(c["out"], c["xa"], c["counts"]),
                weight_grad(c["xa"], c["h"], c["counts"]))

    run()  # compile first: Triton's first launch may touch the device in ways the check below would flag
    sched, offsets = row_tiles(c["counts"], 400, 64)
    assert torch.equal(sched.cpu(), tile_schedule_reference(p["counts"], 400, 64))
    assert torch.equal(offsets.cpu(), row_offsets(p["counts"]))
    torch.cuda.set_sync_debug_mode("error")  # counts stay on the device: no kernel may sync the host on them
    try:
        out, ha, dB, dA = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.cpu(), expand_add_reference(p["out"], p["xa"], p["B"], p["counts"]),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ha.cpu(), contract_reference(p["h"], p["A"], p["counts"], 0.25),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dB.cpu(), weight_grad_reference(p["out"], p["xa"], p["counts"]),
                               rtol=RTOL, atol=1e-4)  # sums of up to 200 products
    torch.testing.assert_close(dA.cpu(), weight_grad_reference(p["xa"], p["h"], p["counts"]),
                               rtol=RTOL, atol=1e-4)


@pytest.mark.gpu
@needs_cuda_triton
def test_cuda_bf16_kernels_match_float32_references():
    p = _problem(counts=[0, 1, 130, 64, 5, 0, 200], N=3072, r=32, K=512, dtype=torch.bfloat16)
    f = {k: v.float() if v.is_floating_point() else v for k, v in p.items()}
    c = {k: v.cuda() for k, v in p.items()}
    errs = {
        "expand_add_": rel_err(expand_add_(c["out"].clone(), c["xa"], c["B"], c["counts"]),
                               expand_add_reference(f["out"], f["xa"], f["B"], f["counts"])),
        "contract": rel_err(contract(c["h"], c["A"], c["counts"]),
                            contract_reference(f["h"], f["A"], f["counts"])),
        "dB": rel_err(weight_grad(c["out"], c["xa"], c["counts"]),
                      weight_grad_reference(f["out"], f["xa"], f["counts"])),
        "dA": rel_err(weight_grad(c["xa"], c["h"], c["counts"]),
                      weight_grad_reference(f["xa"], f["h"], f["counts"])),
    }
    assert all(e <= REL_BF16_KERNEL for e in errs.values()), errs


@pytest.mark.gpu
@needs_cuda_triton
def test_cuda_bf16_triton_module_matches_the_cpu_float32_path():
    ref = _experts(rank=8, LT=64, FI=48)
    fast = copy.deepcopy(ref).to(device="cuda", dtype=torch.bfloat16)
    fast.lora_impl = "triton"
    ref = copy.deepcopy(fast).to(device="cpu", dtype=torch.float32)  # the same bf16-rounded weights
    ref.lora_impl = "torch"
    counts = torch.tensor(COUNTS)
    x, dy = torch.randn(61, 64).bfloat16(), torch.randn(61, 64).bfloat16()
    got = _forward_backward(fast, x.cuda(), counts.cuda(), dy.cuda())
    want = _forward_backward(ref, x.float(), counts, dy.float())
    errs = {"out": rel_err(got[0], want[0]), **{n: rel_err(got[1][n], want[1][n]) for n in want[1]}}
    assert all(e <= REL_BF16_MODULE for e in errs.values()), errs
