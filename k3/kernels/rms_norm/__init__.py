"""RMSNorm with a weight: the reference (``naive``) and one Triton kernel (``triton``), and the dispatch the model
calls. The kernel serves only inside ``k3.kernels.small_ops_mode.triton_small_ops()``, for tensors it runs on
that carry no gradient (``triton_serves``); everything else is the reference."""

from __future__ import annotations

import torch

from k3.kernels.small_ops_mode import triton_serves
from k3.kernels.rms_norm.naive import rms_norm_naive
from k3.kernels.rms_norm.triton import MAX_DIM, rms_norm_triton

__all__ = ["rms_norm", "rms_norm_naive", "rms_norm_triton"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · cast(x · rsqrt(mean(x²) + eps))`` over the last dim (``naive``'s docstring): ``x [..., dim]`` ->
    ``[..., dim]``."""
    if x.shape[-1] <= MAX_DIM and triton_serves(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_naive(x, weight, eps)
