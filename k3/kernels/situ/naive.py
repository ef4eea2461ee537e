"""SiTU-GLU (architecture §2.4) in plain torch: the form every other one is held to.

    SiTU(g, u) = [β1 · tanh(g / β1) · σ(g)] ⊙ [β2 · tanh(u / β2)]      (β1 = 4, β2 = 25: |SiTU| ≤ β1 · β2 = 100)

computed in float32 and cast back to the gate's dtype. The soft tanh clip is the point: a hard clip is not the same
function.
"""

from __future__ import annotations

import torch

__all__ = ["situ_naive"]


def situ_naive(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of the gate and up projections (same shape); float32 math, result in gate's dtype."""
    g, u = gate.float(), up.float()
    out = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)
