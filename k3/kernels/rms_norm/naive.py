"""RMSNorm with a weight, as the K3 reference computes it (KimiRMSNorm): the plain form every other one is held to.

    y = weight · cast_{dtype(x)}(x̂ · rsqrt(mean(x̂²) + eps)),   x̂ = float32(x)

The normalisation runs in float32 and is cast back to the input's dtype *before* the weight multiplies it, so a
BF16 model rounds twice (after the normalisation, after the weight), as the reference does.
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm_naive"]


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., dim]``, ``weight [dim]`` -> ``[..., dim]`` in ``promote(weight, x)``'s dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
