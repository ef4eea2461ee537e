"""RMSNorm as the K3 reference computes it, and the gated RMSNorm on KDA's output.

Both run their op in ``k3.kernels`` (``rms_norm``, ``head_norms.gated_rms_norm``): the plain form (its ``naive.py``
is the math) everywhere but in the embedded engine's window-mode decode on CUDA, which asks for the same math in one
Triton kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.kernels.head_norms import gated_rms_norm
from k3.kernels.rms_norm import rms_norm
from k3.model.precision import KeepsFloat32

__all__ = ["RMSNorm", "GatedRMSNorm"]


class RMSNorm(nn.Module):
    """Normalise in float32, cast back to the input dtype, then multiply by ``weight`` (KimiRMSNorm)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> ``[..., dim]`` in x's dtype: ``weight · cast(x · rsqrt(mean(x²) + eps))``."""
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(KeepsFloat32):
    """KDA's output norm per head: ``rmsnorm(x) · weight · sigmoid(gate)``, all in float32 (weight F32)."""

    float32_params = ("weight",)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``x, gate [..., dim]`` -> ``[..., dim]`` in ``out_dtype`` (``k3.kernels.head_norms.gated_rms_norm``)."""
        return gated_rms_norm(x, gate, self.weight, self.eps, out_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
