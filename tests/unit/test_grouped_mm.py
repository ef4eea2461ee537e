"""grouped_mm and grouped_weight_grad == the per-expert loop, on both implementations, with empty experts, gradients and errors."""

from __future__ import annotations

import pytest
import torch

from k3.kernels.grouped_mm import (grouped_mm, grouped_mm_reference, grouped_weight_grad,
                                   grouped_weight_grad_reference, native_grouped_mm_supported)


def operands(counts, d_in=16, d_out=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), d_in, generator=gen).to(dtype)
    w = torch.randn(len(counts), d_out, d_in, generator=gen).to(dtype)
    return x, w, counts


@pytest.mark.parametrize("impl", ["native", "padded", "auto"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 4, 0], [0, 6], [1, 1, 1, 1, 1]])
def test_matches_loop_reference(impl, counts):
    x, w, c = operands(counts)
    torch.testing.assert_close(grouped_mm(x, w, c, impl=impl), grouped_mm_reference(x, w, c), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["native", "padded"])
def test_gradients_match_loop_reference(impl):
    x, w, c = operands([4, 0, 3, 0])
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    # .sum() sends a stride-0 gradient, which the native backward needs densified
    gx, gw = torch.autograd.grad(grouped_mm(x1, w1, c, impl=impl).sum(), [x1, w1])
    rx, rw = torch.autograd.grad(grouped_mm_reference(x2, w2, c).sum(), [x2, w2])
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)
    assert torch.equal(gw[1], torch.zeros_like(gw[1]))  # an expert with no rows gets no gradient


def test_bfloat16_native():
    x, w, c = operands([2, 3, 0, 3], dtype=torch.bfloat16)
    assert native_grouped_mm_supported(x, w)
    ref = grouped_mm_reference(x.float(), w.float(), c)
    torch.testing.assert_close(grouped_mm(x, w, c).float(), ref, atol=0.1, rtol=0.02)


def test_unaligned_shapes_fall_back_to_padded():
    x, w, c = operands([2, 3], d_in=6, d_out=5)  # 6·4 bytes is not a multiple of 16
    assert not native_grouped_mm_supported(x, w)
    torch.testing.assert_close(grouped_mm(x, w, c), grouped_mm_reference(x, w, c), atol=1e-5, rtol=1e-5)
    assert not native_grouped_mm_supported(x.double(), w.double())


def test_no_rows():
    x, w, c = operands([0, 0, 0])
    assert grouped_mm(x, w, c).shape == (0, 8)


def test_bad_inputs_have_clear_errors():
    x, w, c = operands([2, 3])
    with pytest.raises(ValueError, match="sum to 4"):
        grouped_mm(x, w, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"expected \[E\] = \[2\]"):
        grouped_mm(x, w, torch.tensor([5]))
    with pytest.raises(ValueError, match="same in"):
        grouped_mm(x[:, :3], w, c)
    with pytest.raises(ValueError, match="integer"):
        grouped_mm(x, w, c.float())
    with pytest.raises(ValueError, match="impl='bmm'"):
        grouped_mm(x, w, c, impl="bmm")


def test_strided_views_go_native_without_copies():
    """Column slices of a wider buffer (the fused expert LoRA's operands) are taken as they are."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 4])
    buf = torch.randn(7, 4 + 16 + 4, generator=gen)
    wbuf = torch.randn(3, 8, 4 + 16, generator=gen)
    x, w = buf[:, 4:20], wbuf[:, :, 4:]  # both strided, 16-byte aligned
    assert native_grouped_mm_supported(x, w)
    torch.testing.assert_close(grouped_mm(x, w, counts, impl="native"), grouped_mm_reference(x, w, counts),
                               atol=1e-5, rtol=1e-5)
    w_t = torch.randn(3, 16, 8, generator=gen).transpose(1, 2)  # [E, out, in] with unit stride along out
    assert native_grouped_mm_supported(x, w_t)
    torch.testing.assert_close(grouped_mm(x, w_t, counts), grouped_mm_reference(x, w_t, counts), atol=1e-5, rtol=1e-5)
    odd = torch.randn(3, 8, 21, generator=gen)[:, :, 1:17]  # rows 84 bytes apart: not the 16-byte rule
    assert not native_grouped_mm_supported(x, odd)
    torch.testing.assert_close(grouped_mm(x, odd, counts), grouped_mm_reference(x, odd, counts), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["native", "padded", "auto"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 4, 0], [1, 1, 1, 1, 1]])
def test_weight_grad_matches_loop_reference(impl, counts):
    gen = torch.Generator().manual_seed(2)
    c = torch.tensor(counts)
    g = torch.randn(int(c.sum()), 8, generator=gen)
    x = torch.randn(int(c.sum()), 12, generator=gen)
    got = grouped_weight_grad(g, x, c, impl=impl)
    assert got.shape == (len(counts), 8, 12)
    torch.testing.assert_close(got, grouped_weight_grad_reference(g, x, c), atol=1e-5, rtol=1e-5)
    for e in (i for i, n in enumerate(counts) if n == 0):
        assert torch.equal(got[e], torch.zeros(8, 12))


def test_weight_grad_is_the_weight_gradient_of_grouped_mm():
    x, w, c = operands([2, 0, 5, 1])
    w = w.requires_grad_()
    g = torch.randn(x.shape[0], w.shape[1])
    (want,) = torch.autograd.grad(grouped_mm(x, w, c), [w], g)
    torch.testing.assert_close(grouped_weight_grad(g, x, c), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grouped_weight_grad(g.bfloat16(), x.bfloat16(), c).float(), want, atol=0.1, rtol=0.02)


def test_weight_grad_bad_inputs_have_clear_errors():
    g, x, c = torch.randn(5, 8), torch.randn(5, 12), torch.tensor([2, 3])
    with pytest.raises(ValueError, match="same N"):
        grouped_weight_grad(g[:4], x, c)
    with pytest.raises(ValueError, match="integer"):
        grouped_weight_grad(g, x, c.float())
    with pytest.raises(ValueError, match="sum to 4"):
        grouped_weight_grad(g, x, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="impl='loop'"):
        grouped_weight_grad(g, x, c, impl="loop")
    assert grouped_weight_grad(g[:0], x[:0], torch.tensor([0, 0])).shape == (2, 8, 12)
