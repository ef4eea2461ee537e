"""The Block-AttnRes mix over depth (architecture §2.1) in plain torch: the form every other one is held to.

For candidates ``v_1 … v_n`` (stored blocks, then the live partial sum), per token:

    s_i = Σ_h rmsnorm(v_i)_h · q_h,   q = norm_weight ⊙ proj_weight        (float32; rmsnorm without a weight)
    out = cast_{dtype(v_n)}( Σ_i softmax(s)_i · v_i )

``proj_weight`` is a scoring vector (the ``*_res_proj`` ``Linear(hidden, 1)``'s weight), not a projection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["attn_res_mix_naive"]


def attn_res_mix_naive(candidates: Sequence[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """``candidates``: n tensors ``[..., hidden]``; ``norm_weight [hidden]``; ``proj_weight [1, hidden]`` ->
    ``[..., hidden]`` in the last candidate's dtype."""
    values = torch.stack([c.float() for c in candidates])  # [n, ..., hidden]
    query = norm_weight.float() * proj_weight.float()[0]  # the pseudo-query [hidden]
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    weights = torch.softmax((normed * query).sum(-1), dim=0).unsqueeze(-1)  # [n, ..., 1]
    return (weights * values).sum(0).to(candidates[-1].dtype)
