"""KDA's per-head norms (the q/k L2 norm, the gated output RMSNorm): the references (``naive``), one Triton kernel
each (``triton``), and the dispatch the model calls. The kernels serve only inside
``k3.kernels.small_ops_mode.triton_small_ops()``, for tensors they run on that carry no gradient
(``triton_serves``); everything else is the reference."""

from __future__ import annotations

import torch

from k3.kernels.small_ops_mode import triton_serves
from k3.kernels.head_norms.naive import gated_rms_norm_naive, l2_norm_naive
from k3.kernels.head_norms.triton import MAX_DIM, gated_rms_norm_triton, l2_norm_triton

__all__ = ["gated_rms_norm", "gated_rms_norm_naive", "gated_rms_norm_triton", "l2_norm", "l2_norm_naive",
           "l2_norm_triton"]


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dim (``naive``): ``[..., dim]`` -> float32 ``[..., dim]``."""
    if x.shape[-1] <= MAX_DIM and triton_serves(x):
        return l2_norm_triton(x, eps)
    return l2_norm_naive(x, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """``rmsnorm(x) · weight · sigmoid(gate)`` over the last dim in float32 (``naive``), cast to ``out_dtype``."""
    if x.shape[-1] <= MAX_DIM and triton_serves(x, gate, weight):
        return gated_rms_norm_triton(x, gate, weight, eps, out_dtype)
    return gated_rms_norm_naive(x, gate, weight, eps, out_dtype)
