"""K3's KDA gate in torch: the log-space decay from the raw gate logit.

The model's KDA layer computes it before the core on every backend but fla, where ``kda_core_with_gate`` fuses
it into fla's kernels (``use_gate_in_kernel``); this is also the CPU oracle of that in-kernel gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["kda_gate"]


def kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """K3's log-space decay from the raw gate logit, in torch (the model's KDA layer and the CPU oracle of fla's
    in-kernel gate).

    Args:
        z: ``[..., heads, K]`` raw logit. A_log: ``[heads]``. dt_bias: ``[heads * K]``.
        lower_bound: negative bound (``lb · sigmoid(exp(A_log) · (z + dt_bias))``) or None
            (``-exp(A_log) · softplus(z + dt_bias)``).

    Returns:
        ``[..., heads, K]`` float32 log decay.
    """
    heads, K = z.shape[-2:]
    z = z.float() + dt_bias.float().view(heads, K)
    rate = A_log.float().exp().view(heads, 1)
    if lower_bound is None:
        return -rate * F.softplus(z)
    return lower_bound * torch.sigmoid(rate * z)
