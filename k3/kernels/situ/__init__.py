"""SiTU-GLU: the reference (``naive``) and one Triton kernel (``triton``), and the dispatch the model calls. The
kernel serves only inside ``k3.kernels.small_ops_mode.triton_small_ops()``, for tensors it runs on that carry
no gradient (``triton_serves``); everything else is the reference."""

from __future__ import annotations

import torch

from k3.kernels.small_ops_mode import triton_serves
from k3.kernels.situ.naive import situ_naive
from k3.kernels.situ.triton import situ_triton

__all__ = ["situ", "situ_naive", "situ_triton"]


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of the gate and up projections (``naive``'s docstring): same shape in, gate's dtype out."""
    if triton_serves(gate, up):
        return situ_triton(gate, up, beta, linear_beta)
    return situ_naive(gate, up, beta, linear_beta)
