"""Swapping batch and sequence axes with canonical strides (k3/megatron/sequence_major.py), and why it matters:
torch.matmul, which megatron's linears call, folds ``[s, 1, in] @ [in, out]`` into one GEMM only then."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from k3.megatron.sequence_major import swap_batch_and_sequence


def _canonical(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape).stride()


@pytest.mark.parametrize("shape", [(1, 5, 3), (4, 1, 3), (2, 5, 3), (1, 1, 3), (3, 4)])
def test_the_swap_has_the_values_of_a_transpose_and_canonical_strides(shape):
    x = torch.randn(shape)
    y = swap_batch_and_sequence(x)
    assert torch.equal(y, x.transpose(0, 1))
    assert y.stride() == _canonical(tuple(y.shape))


def test_a_size_one_axis_swaps_without_a_copy_and_drops_its_stale_stride():
    x = torch.randn(1, 6, 4)
    stale = x.transpose(0, 1).contiguous()
    assert stale.data_ptr() == x.data_ptr() and stale.stride() == (4, 24, 1)  # what .contiguous() leaves
    y = swap_batch_and_sequence(x)
    assert y.data_ptr() == x.data_ptr() and y.stride() == (4, 4, 1)


def test_the_gradient_flows_back_through_the_swap():
    x = torch.randn(1, 6, 4, requires_grad=True)
    w = torch.randn(4, 4)
    (swap_batch_and_sequence(x) @ w).sum().backward()
    assert torch.allclose(x.grad, w.sum(1).expand(1, 6, 4))


def _gemm_ops(x: torch.Tensor, w: torch.Tensor) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.matmul(x, w.t())
    return {e.name for e in prof.events() if e.name in ("aten::mm", "aten::bmm")}


def test_matmul_with_a_frozen_weight_runs_one_gemm_only_on_canonical_strides():
    o = torch.randn(1, 64, 32)  # [b, s, in] out of an attention core
    w = torch.randn(16, 32)  # a frozen base weight [out, in]
    assert _gemm_ops(o.transpose(0, 1).contiguous(), w) == {"aten::bmm"}  # 64 one-row GEMMs, w read 64 times
    assert _gemm_ops(swap_batch_and_sequence(o), w) == {"aten::mm"}


class _FrozenLinear(torch.autograd.Function):
    """Megatron's linear with a frozen weight, as far as layouts go: both passes through torch.matmul on 3-D."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return torch.matmul(grad, w), None


@pytest.mark.parametrize("b", [1, 2])
def test_the_head_s_gradient_comes_back_as_one_gemm_with_canonical_grad(b):
    """GPTModel returns logits as [s, b, v].transpose(0, 1).contiguous(): the gradient coming back is a transposed
    view, and the head's backward matmul splits it per token unless it is made canonical first."""
    from k3.megatron.sequence_major import canonical_grad

    s, h, v = 16, 8, 32
    hidden = torch.randn(s, b, h, requires_grad=True)
    head = torch.randn(v, h)
    weight = torch.randn(b, s, v)

    def backward_gemms(guard: bool) -> tuple[set[str], torch.Tensor]:
        hidden.grad = None
        logits = _FrozenLinear.apply(hidden, head)
        logits = canonical_grad(logits) if guard else logits
        loss = (logits.transpose(0, 1).contiguous() * weight).sum()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss.backward()
        return {e.name for e in prof.events() if e.name in ("aten::mm", "aten::bmm")}, hidden.grad.clone()

    plain, want = backward_gemms(False)
    guarded, got = backward_gemms(True)
    assert plain == {"aten::bmm"} and guarded == {"aten::mm"}
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_canonical_grad_leaves_tensors_without_a_gradient_alone():
    from k3.megatron.sequence_major import canonical_grad

    x = torch.randn(3, 1, 4)
    assert canonical_grad(x) is x
    y = torch.randn(3, 1, 4, requires_grad=True) * 1.0
    assert canonical_grad(y) is y  # the same tensor: downstream views and in-place ops stay allowed
