"""KDA's per-head norms in plain torch: the forms every other one is held to (architecture §2.2).

- ``l2_norm_naive``: q and k after the short conv, ``x / sqrt(Σx² + eps)`` over a head (fla's l2norm: eps inside
  the root), float32 out.
- ``gated_rms_norm_naive``: the output norm, ``rmsnorm(o) · weight · sigmoid(gate)`` over a head, all in float32,
  cast to the layer's dtype.
"""

from __future__ import annotations

import torch

__all__ = ["gated_rms_norm_naive", "l2_norm_naive"]


def l2_norm_naive(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., dim]`` -> ``[..., dim]`` float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_rms_norm_naive(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """``x, gate [..., dim]``, ``weight [dim]`` -> ``[..., dim]`` in ``out_dtype``."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(out_dtype)
