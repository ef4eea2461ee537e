"""The Block-AttnRes mix in one Triton kernel (after one ``torch.stack`` of the candidates): ``naive``'s math, one
token row per program.

The program walks the n candidates once, with an online softmax: for each it loads the row, scores it
(``Σ rmsnorm(v) · q`` in float32), and folds it into a running maximum, denominator and weighted sum, rescaled
when the maximum moves; the result is the weighted sum over the denominator, cast to the last candidate's dtype.
The same sums as the reference in another order, so a result can differ from it by a unit in the last place,
rarely. The reference is about fifteen kernels for a mix (the casts, the stack, the norm's five, the products and
sums, the softmax); a decode step of the 4layer width runs eight mixes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.kernels.availability import triton

__all__ = ["MAX_DIM", "attn_res_mix_triton"]

MAX_DIM = 16384  # one row in one program's registers (K3's hidden: 7168)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _mix_rows(values_ptr, norm_w_ptr, proj_w_ptr, out_ptr, n_candidates, n_rows, n_cols, eps,
                  BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < n_cols
        # the pseudo-query, as the reference forms it: float32(norm weight) · float32(proj weight)
        q = (tl.load(norm_w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
             * tl.load(proj_w_ptr + cols, mask=keep, other=0.0).to(tl.float32))
        top = -float("inf")
        denom = 0.0
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(n_candidates):
            base = (i * n_rows + row).to(tl.int64) * n_cols
            v = tl.load(values_ptr + base + cols, mask=keep, other=0.0).to(tl.float32)
            score = tl.sum(v * tl.rsqrt(tl.sum(v * v, axis=0) / n_cols + eps) * q, axis=0)
            new_top = tl.maximum(top, score)
            shrink = tl.exp(top - new_top)
            weight = tl.exp(score - new_top)
            acc = acc * shrink + weight * v
            denom = denom * shrink + weight
            top = new_top
        tl.store(out_ptr + row.to(tl.int64) * n_cols + cols, (acc / denom).to(out_ptr.dtype.element_ty), mask=keep)


def attn_res_mix_triton(candidates: Sequence[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """``naive.attn_res_mix_naive`` in one kernel: n ≥ 1 candidates ``[..., hidden]`` of one shape and device ->
    ``[..., hidden]`` in the last one's dtype. ValueError for no candidates, different shapes or devices, weights
    that are not ``[hidden]`` / ``[1, hidden]``, or ``hidden`` above ``MAX_DIM``; RuntimeError without Triton."""
    if triton is None:
        raise RuntimeError("attn_res_mix_triton: Triton is not installed")
    if not candidates:
        raise ValueError("attn_res_mix_triton: no candidates to mix")
    last = candidates[-1]
    shape, dim = last.shape, last.shape[-1]
    if any(c.shape != shape or c.device != last.device for c in candidates):
        raise ValueError(f"attn_res_mix_triton: candidates {[tuple(c.shape) for c in candidates]} on "
                         f"{sorted({str(c.device) for c in candidates})}: expected one shape on one device")
    if norm_weight.shape != (dim,) or proj_weight.shape != (1, dim):
        raise ValueError(f"attn_res_mix_triton: norm weight {tuple(norm_weight.shape)}, proj weight "
                         f"{tuple(proj_weight.shape)} for rows of {dim}: expected ({dim},) and (1, {dim})")
    if dim > MAX_DIM:
        raise ValueError(f"attn_res_mix_triton: rows of {dim} > {MAX_DIM} (one row per program)")
    if norm_weight.device != last.device or proj_weight.device != last.device:
        raise ValueError(f"attn_res_mix_triton: candidates on {last.device}, weights on {norm_weight.device} and "
                         f"{proj_weight.device}")
    values = torch.stack([c.reshape(-1, dim) for c in candidates])  # [n, rows, dim], contiguous
    rows = values.shape[1]
    out = torch.empty((rows, dim), dtype=last.dtype, device=last.device)
    if rows:
        block = triton.next_power_of_2(dim)
        _mix_rows[(rows,)](values, norm_weight.contiguous(), proj_weight.contiguous(), out, len(candidates), rows,
                           dim, float(eps), BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return out.view(shape)
