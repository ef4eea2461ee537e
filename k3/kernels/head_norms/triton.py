"""KDA's per-head norms as Triton kernels: ``naive``'s arithmetic over tiles of ``ROWS`` heads × ``head_dim``.

A decode step of the 4layer width normalises 64 tokens × 96 heads of 128 values three times per KDA layer (q, k
and the gated output norm): tiny rows, where the reference's five to ten kernels each are mostly launch and
latency. One program takes ``ROWS`` rows; the sums are float32 (in another order than torch's, so a result can
differ from the reference by a unit in its last place, rarely).
"""

from __future__ import annotations

import torch

from k3.kernels.availability import triton

__all__ = ["MAX_DIM", "ROWS", "gated_rms_norm_triton", "l2_norm_triton"]

MAX_DIM = 1024  # a head (K3: 128), times ROWS, in one program's registers
ROWS = 16  # rows per program

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _l2_rows(x_ptr, out_ptr, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        keep = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        at = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + at, mask=keep, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]
        tl.store(out_ptr + at, y, mask=keep)

    @triton.jit
    def _gated_rms_rows(x_ptr, gate_ptr, w_ptr, out_ptr, n_rows, n_cols, eps, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        keep = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        at = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + at, mask=keep, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + at, mask=keep, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        normed = x * tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)[:, None]
        tl.store(out_ptr + at, (normed * w[None, :] * tl.sigmoid(g)).to(out_ptr.dtype.element_ty), mask=keep)


def _rows_of(name: str, x: torch.Tensor) -> torch.Tensor:
    if triton is None:
        raise RuntimeError(f"{name}: Triton is not installed")
    if x.shape[-1] > MAX_DIM:
        raise ValueError(f"{name}: rows of {x.shape[-1]} > {MAX_DIM} (a head per row)")
    return x.reshape(-1, x.shape[-1]).contiguous()


def _launch(kernel, rows: int, dim: int, eps: float, *pointers: torch.Tensor) -> None:
    if rows:
        kernel[(triton.cdiv(rows, ROWS),)](*pointers, rows, dim, float(eps), ROWS=ROWS,
                                           BLOCK=triton.next_power_of_2(dim), num_warps=4)


def l2_norm_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``naive.l2_norm_naive`` in one kernel: ``x [..., dim]`` -> ``[..., dim]`` float32."""
    rows = _rows_of("l2_norm_triton", x)
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    _launch(_l2_rows, rows.shape[0], rows.shape[1], eps, rows, out)
    return out.view(x.shape)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """``naive.gated_rms_norm_naive`` in one kernel. ValueError for a gate of another shape, a weight that is not
    ``[dim]``, or tensors on several devices."""
    dim = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (dim,):
        raise ValueError(f"gated_rms_norm_triton: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight "
                         f"{tuple(weight.shape)}: expected one shape and a weight of ({dim},)")
    if len({x.device, gate.device, weight.device}) != 1:
        raise ValueError(f"gated_rms_norm_triton: x on {x.device}, gate on {gate.device}, weight on {weight.device}")
    rows, gates = _rows_of("gated_rms_norm_triton", x), gate.reshape(-1, dim).contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    _launch(_gated_rms_rows, rows.shape[0], dim, eps, rows, gates, weight.contiguous(), out)
    return out.view(x.shape)
