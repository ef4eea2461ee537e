"""Packed sequences (``k3.megatron.packed``): the KDA short conv and the MLA core over packed sequences equal each
sequence run alone (forward and every gradient), against an independent block-diagonal reference too; the THD
parameters and their errors. The CUDA forms (torch's FlashAttention varlen kernel in BF16) are marked ``gpu``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from k3.megatron.packed import (
    K3PackedSeqParams,
    check_bounds,
    packed_causal_attention,
    packed_causal_conv,
    packed_seq_params,
    segment_ids,
    sequence_bounds,
)
from k3.model.kda import CausalConv1d

LENGTHS = [5, 1, 9, 3, 12]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _conv(channels=6, kernel=4, seed=0):
    conv = CausalConv1d(channels, kernel)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return conv


# ---------------------------------------------------------------------------------------------- conv
def test_packed_conv_equals_each_sequence_alone_with_gradients():
    conv, cu = _conv(), _cu(LENGTHS)
    x = torch.randn(1, int(cu[-1]), 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w_out = torch.randn(1, int(cu[-1]), 6, generator=torch.Generator().manual_seed(2))
    y = packed_causal_conv(x, conv, cu)
    assert y.shape == x.shape and y.dtype == torch.float32
    gx, gw = torch.autograd.grad((y * w_out).sum(), [x, conv.weight])
    x_ref = x.detach().clone().requires_grad_(True)
    total = 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        y_n, _ = conv(x_ref[:, a:b], None)
        torch.testing.assert_close(y[:, a:b], y_n, rtol=0, atol=1e-6)
        total = total + (y_n * w_out[:, a:b]).sum()
    gx_ref, gw_ref = torch.autograd.grad(total, [x_ref, conv.weight])
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)


def test_packed_conv_without_bounds_leaks_across_sequences():
    # the control: one conv over the whole stream differs at the start of every later sequence
    conv, cu = _conv(), _cu([6, 6])
    x = torch.randn(1, 12, 6, generator=torch.Generator().manual_seed(3))
    leaked, _ = conv(x, None)
    packed = packed_causal_conv(x, conv, cu)
    assert torch.equal(packed[:, :6], leaked[:, :6])
    assert (packed[:, 6:9] - leaked[:, 6:9]).abs().max() > 1e-2


def test_packed_conv_with_histories_equals_the_conv_after_each_history():
    conv, cu = _conv(channels=4, kernel=4), _cu([4, 7, 3])
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 14, 4, generator=gen)
    history = torch.randn(3, 4, 3, generator=gen)
    y = packed_causal_conv(x, conv, cu, history)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_n, _ = conv(x[:, a:b], history[n:n + 1])
        torch.testing.assert_close(y[:, a:b], y_n, rtol=0, atol=1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda c: packed_causal_conv(torch.zeros(2, 5, 6), c, [0, 5]), r"expected \[1, tokens, channels\]"),
    (lambda c: packed_causal_conv(torch.zeros(1, 5, 6), c, [0, 4]), "from 0 to the 5 tokens"),
    (lambda c: packed_causal_conv(torch.zeros(1, 5, 6), c, [0, 5], torch.zeros(2, 6, 3)), r"expected \(1, 6, 3\)"),
])
def test_packed_conv_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call(_conv())


# ---------------------------------------------------------------------------------------------- attention
def _qkv(T, heads=3, dk=12, dv=8, seed=5, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, T, d, generator=gen).to(device=device, dtype=dtype) for d in (dk, dk, dv)]


def _block_causal_mask(cu):
    """The independent reference: one attention over the stream with a block-diagonal causal mask."""
    seg = segment_ids(cu)
    pos = torch.arange(seg.numel())
    return (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])


def test_packed_attention_equals_each_sequence_alone_and_the_block_diagonal_mask():
    cu = _cu(LENGTHS)
    leaves = [t.requires_grad_(True) for t in _qkv(int(cu[-1]))]
    w_out = torch.randn(1, 3, int(cu[-1]), 8, generator=torch.Generator().manual_seed(6))
    o = packed_causal_attention(*leaves, 0.3, cu)
    assert o.shape == (1, 3, int(cu[-1]), 8)
    grads = torch.autograd.grad((o * w_out).sum(), leaves)
    ref = [t.detach().clone().requires_grad_(True) for t in leaves]
    masked = F.scaled_dot_product_attention(*ref, attn_mask=_block_causal_mask(cu), scale=0.3)
    torch.testing.assert_close(o, masked, rtol=0, atol=1e-6)
    for a, b in zip(grads, torch.autograd.grad((masked * w_out).sum(), ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    q, k, v = (t.detach() for t in leaves)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # and each sequence on its own
        alone = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=0.3)
        torch.testing.assert_close(o[:, :, a:b], alone, rtol=0, atol=1e-6)


def test_packed_attention_bad_inputs():
    q, k, v = _qkv(10)
    with pytest.raises(ValueError, match=r"expected q, k \[1, heads, tokens, dk\]"):
        packed_causal_attention(q.expand(2, -1, -1, -1), k, v, 0.3, [0, 10])
    with pytest.raises(ValueError, match="backend='flash'"):
        packed_causal_attention(q, k, v, 0.3, [0, 10], backend="flash")
    with pytest.raises(ValueError, match="from 0 to the 10 tokens"):
        packed_causal_attention(q, k, v, 0.3, [0, 3, 9])
    with pytest.raises(RuntimeError, match="needs CUDA"):
        packed_causal_attention(q, k, v, 0.3, [0, 10], backend="varlen")


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, causal=False):
    """torch's varlen API in plain torch: ``[T, heads, d]`` in and out, one head dim, default scale d^-1/2."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        out[a:b] = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=causal,
                                                  scale=scale).transpose(0, 1)
    return out


def _varlen_2_10(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    assert window_size in ((-1, -1), (-1, 0))
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size == (-1, 0))


def _varlen_2_9(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, None, is_causal)


@pytest.mark.parametrize("api", [_varlen_2_10, _varlen_2_9])
def test_varlen_call_pads_v_scales_and_masks_as_the_reference(api):
    # the CUDA path's plumbing on the CPU, with the kernel replaced by its definition: v padded to the key width
    # and cut back, the layout transposed, causal per sequence, the scale passed (2.10) or folded into q (2.9)
    from k3.megatron import packed

    cu = _cu(LENGTHS)
    q, k, v = _qkv(int(cu[-1]))
    got = packed._varlen_attention(q, k, v, 0.3, cu, api, set(inspect.signature(api).parameters))
    want = packed_causal_attention(q, k, v, 0.3, cu, backend="sequences")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- THD parameters
def test_packed_seq_params_carry_device_and_host_bounds():
    params = packed_seq_params([0, 3, 10, 12], "cpu")
    assert isinstance(params, K3PackedSeqParams) and params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.tolist() == [0, 3, 10, 12]
    assert params.max_seqlen_q == params.max_seqlen_kv == 7
    assert sequence_bounds(params).tolist() == [0, 3, 10, 12] and sequence_bounds(None) is None
    assert segment_ids(torch.tensor([0, 2, 2, 5])).tolist() == [0, 0, 2, 2, 2]


def test_thd_parameters_errors():
    from megatron.core.packed_seq_params import PackedSeqParams

    with pytest.raises(ValueError, match="qkv_format='sbhd'"):
        sequence_bounds(PackedSeqParams(qkv_format="sbhd"))
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4]),
                             cu_seqlens_q_padded=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        sequence_bounds(padded)
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32))
    assert sequence_bounds(plain).tolist() == [0, 4, 9]  # megatron's own type: read from the device tensor
    for bad in ([1, 5], [0, 5, 3], [[0, 5]], [0.0, 5.0]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            check_bounds(bad)


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_attention_on_cuda_equals_each_sequence_alone(dtype):
    """BF16 picks torch's FlashAttention varlen kernel (v padded to MLA's key width 192); float32 the per-sequence
    SDPA. Both against the float32 per-sequence reference on the same rounded inputs."""
    from k3.megatron import packed

    cu = _cu([300, 17, 1, 513, 64])
    leaves = [t.requires_grad_(True) for t in _qkv(int(cu[-1]), heads=4, dk=192, dv=128, dtype=dtype, device="cuda")]
    if dtype == torch.bfloat16 and packed._varlen_attn() is not None:  # torch >= 2.9: the varlen kernel runs
        assert packed._varlen_usable(leaves[0], leaves[2])
    o = packed_causal_attention(*leaves, 192**-0.5, cu)
    w_out = torch.randn(o.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    grads = torch.autograd.grad((o.float() * w_out).sum(), leaves)
    ref = [t.detach().float().requires_grad_(True) for t in leaves]
    o_ref = packed_causal_attention(*ref, 192**-0.5, cu, backend="sequences")
    grads_ref = torch.autograd.grad((o_ref * w_out).sum(), ref)

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(o, o_ref) < tol
    for a, b in zip(grads, grads_ref):
        assert rel(a, b) < 2 * tol
