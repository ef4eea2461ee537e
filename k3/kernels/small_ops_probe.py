"""One check, before the fused kernels of the model's small ops (RMSNorm, SiTU, the AttnRes mix, KDA's head norms)
serve a caller on a device: do they build there, and do they agree with their plain forms on a few rows?

The embedded engine runs it once before its first fused decode; a kernel that fails to compile (a Triton that
cannot build for this GPU) or disagrees is left for the plain ops, with the reason said, instead of stopping the
rollout.
"""

from __future__ import annotations

import torch

from k3.kernels.attn_res_mix import attn_res_mix_naive, attn_res_mix_triton
from k3.kernels.head_norms import gated_rms_norm_naive, gated_rms_norm_triton, l2_norm_naive, l2_norm_triton
from k3.kernels.rms_norm import rms_norm_naive, rms_norm_triton
from k3.kernels.situ import situ_naive, situ_triton

__all__ = ["probe_small_op_kernels"]

HEAD_DIM = 128  # K3's KDA head: the probe's rows of ``dim`` are cut into heads of this size (whole rows if not)


def _disagreement(name: str, got: torch.Tensor, want: torch.Tensor, scale: float = 0.0) -> str | None:
    """Where ``got`` and ``want`` differ by more than ``rtol`` of ``|want|`` plus ``rtol · scale`` (the size of what a
    sum cancelled: an output of a weighted sum can be near zero while its terms are not)."""
    # Two units in the last place of a 16-bit dtype (each cast may round the other way once); in float32 the
    # exp-based tanh of SiTU is within 32 (``situ/triton.py``).
    rtol = max(2 * torch.finfo(want.dtype).eps, 32 * torch.finfo(torch.float32).eps)
    atol = max(rtol * scale, torch.finfo(want.dtype).tiny)
    bad = ~torch.isclose(got.float(), want.float(), rtol=rtol, atol=atol)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        return (f"{name}: {int(bad.sum())} of {bad.numel()} values differ from the plain form by more than "
                f"{rtol:.2g} relative (+ {atol:.2g}) (e.g. {got.flatten()[i].item()!r} vs "
                f"{want.flatten()[i].item()!r})")
    return None


def probe_small_op_kernels(device: torch.device | str, dtype: torch.dtype, dim: int) -> str | None:
    """Run the kernels on ``[8, dim]`` rows of ``dtype`` on ``device`` against the plain forms; returns None when
    they agree, else the first problem (an exception's type and message, or the disagreement)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(8, dim, generator=gen) * 3).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device=device, dtype=dtype)
    gate = (torch.randn(8, dim, generator=gen) * 6).to(device=device, dtype=dtype)
    up = (torch.randn(8, dim, generator=gen) * 40).to(device=device, dtype=dtype)
    blocks = [x, gate, up]
    head = HEAD_DIM if dim % HEAD_DIM == 0 else dim
    heads, head_gates = x.view(8, -1, head), gate.view(8, -1, head)  # [tokens, heads, head_dim]
    head_w = (1 + 0.1 * torch.randn(head, generator=gen)).to(device)  # float32, as the model keeps it
    proj = (0.05 * torch.randn(1, dim, generator=gen)).to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            checks = (("rms_norm", rms_norm_triton(x, w, 1e-6), rms_norm_naive(x, w, 1e-6)),
                      ("situ", situ_triton(gate, up), situ_naive(gate, up)),
                      ("attn_res_mix", attn_res_mix_triton(blocks, w, proj, 1e-6),
                       attn_res_mix_naive(blocks, w, proj, 1e-6), max(b.abs().max().item() for b in blocks)),
                      ("l2_norm", l2_norm_triton(heads, 1e-6), l2_norm_naive(heads, 1e-6)),
                      ("gated_rms_norm", gated_rms_norm_triton(heads, head_gates, head_w, 1e-6, dtype),
                       gated_rms_norm_naive(heads, head_gates, head_w, 1e-6, dtype)))
    except Exception as e:  # noqa: BLE001 - any build or launch failure is a reason to keep the plain ops
        return f"{type(e).__name__}: {e}"
    return next((p for p in (_disagreement(*c) for c in checks) if p is not None), None)
