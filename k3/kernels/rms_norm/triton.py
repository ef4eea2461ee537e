"""RMSNorm with a weight in one Triton kernel: ``naive.rms_norm_naive``'s arithmetic, one row per program.

Each program loads one row (``dim`` ≤ ``MAX_DIM``, padded to a power of two), sums its squares in float32, and
writes ``weight · cast(x · rsqrt(mean + eps))`` with the same two roundings as the reference (to the input's dtype
after the normalisation, to the output's after the weight). Only the order of the sum differs from torch's, so a
result can differ from the reference by one unit in the last place of the output dtype, rarely. (Triton's
interpreter, which the CPU tests run, truncates float32 -> BF16 where the GPU rounds to nearest even: the CPU tests
hold float32 to the reference within float32 ulps and BF16 within one BF16 ulp; the GPU test is tighter.)

The reference costs seven or eight kernels on a BF16 row (the casts, the square, the mean, the add, the rsqrt and
two products); a decode step of the 4layer width runs about twenty of these norms, where each kernel is a few µs of
launch and latency for under a megabyte of data.
"""

from __future__ import annotations

import torch

from k3.kernels.availability import triton

__all__ = ["MAX_DIM", "rms_norm_triton"]

MAX_DIM = 16384  # one row in one program's registers (K3's widest norm: hidden 7168)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_norm_rows(x_ptr, w_ptr, out_ptr, n_cols, x_stride, out_stride, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=keep, other=0.0).to(tl.float32)
        mean_sq = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=keep)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``naive.rms_norm_naive`` in one kernel: ``x [..., dim]``, ``weight [dim]`` -> ``[..., dim]`` in
    ``promote(weight, x)``'s dtype. ValueError for a weight that is not ``[dim]``, a ``dim`` above ``MAX_DIM``, or
    tensors on different devices; RuntimeError without Triton."""
    if triton is None:
        raise RuntimeError("rms_norm_triton: Triton is not installed")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm_triton: weight {tuple(weight.shape)} for rows of {dim}: expected ({dim},)")
    if dim > MAX_DIM:
        raise ValueError(f"rms_norm_triton: rows of {dim} > {MAX_DIM} (one row per program)")
    if weight.device != x.device:
        raise ValueError(f"rms_norm_triton: x on {x.device}, weight on {weight.device}")
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_rows[(rows.shape[0],)](rows, weight.contiguous(), out, dim, rows.stride(0), out.stride(0),
                                         float(eps), BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return out.view(x.shape)
