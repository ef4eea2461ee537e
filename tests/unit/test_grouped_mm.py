"""grouped_mm == the per-expert loop, on both implementations, with empty experts, gradients and errors."""

from __future__ import annotations

import pytest
import torch

from k3.kernels.grouped_mm import grouped_mm, grouped_mm_reference, native_grouped_mm_supported


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
