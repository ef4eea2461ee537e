"""SiTU-GLU in one Triton kernel: ``naive.situ_naive``'s formula over flat blocks of the gate and up tensors.

The reference is about a dozen kernels (two casts, two divisions, two tanh, a sigmoid, four products, the cast
back); here one pass reads both inputs once and writes the result once. tanh is computed from ``exp`` (Triton's
interpreter, which the CPU tests run, has no ``tanh``): ``sign(z) · (1 − t) / (1 + t)`` with ``t = e^{−2|z|}``, and
for ``|z| < TANH_SERIES_BELOW`` the series ``z · (1 − z²/3 + 2z⁴/15)``, where ``1 − t`` would lose digits; both are
within a few float32 ulps of torch's ``tanh``, so the result, rounded to the gate's dtype, can differ from the
reference's by one unit in its last place, rarely.
"""

from __future__ import annotations

import torch

from k3.kernels.availability import triton

__all__ = ["BLOCK", "TANH_SERIES_BELOW", "situ_triton"]

BLOCK = 1024  # elements per program
TANH_SERIES_BELOW = 0.05  # the series' next term, 17z⁷/315, is < 1e-9 of z here

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _tanh(z, SERIES_BELOW: tl.constexpr):
        a = tl.abs(z)
        t = tl.exp(-2.0 * a)
        far = (1.0 - t) / (1.0 + t)
        z2 = a * a
        near = a * (1.0 - z2 / 3.0 + 2.0 * z2 * z2 / 15.0)
        mag = tl.where(a < SERIES_BELOW, near, far)
        return tl.where(z < 0.0, -mag, mag)

    @triton.jit
    def _situ(gate_ptr, up_ptr, out_ptr, n, beta, linear_beta, BLOCK: tl.constexpr, SERIES_BELOW: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        g = tl.load(gate_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        gate_term = beta * _tanh(g / beta, SERIES_BELOW) * tl.sigmoid(g)
        up_term = linear_beta * _tanh(u / linear_beta, SERIES_BELOW)
        tl.store(out_ptr + offs, (gate_term * up_term).to(out_ptr.dtype.element_ty), mask=keep)


def situ_triton(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """``naive.situ_naive`` in one kernel: ``gate``, ``up`` of one shape -> that shape in gate's dtype. ValueError
    for different shapes or devices; RuntimeError without Triton."""
    if triton is None:
        raise RuntimeError("situ_triton: Triton is not installed")
    if gate.shape != up.shape:
        raise ValueError(f"situ_triton: gate {tuple(gate.shape)} and up {tuple(up.shape)}: expected one shape")
    if gate.device != up.device:
        raise ValueError(f"situ_triton: gate on {gate.device}, up on {up.device}")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    n = g.numel()
    if n:
        _situ[(triton.cdiv(n, BLOCK),)](g, u, out, n, float(beta), float(linear_beta), BLOCK=BLOCK,
                                        SERIES_BELOW=TANH_SERIES_BELOW, num_warps=4)
    return out
