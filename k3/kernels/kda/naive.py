"""KDA core as a per-token recurrence: the oracle every faster form is tested against.

Per head, with the state ``S ∈ R^{K×V}`` held in float32 (architecture §2.2):

    S ← Diag(exp(g_t)) · S                       decay row j of S by exp(g_t[j])
    S ← S + β_t · k_t ⊗ (v_t − Sᵀ k_t)            delta-rule write
    o_t = Sᵀ (scale · q_t)

``q`` and ``k`` arrive already L2-normalised; ``g`` is the log-space decay (≤ 0) after the gate function.
"""

from __future__ import annotations

import torch

__all__ = ["naive_recurrent_kda"]


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence token by token.

    Args:
        q, k: ``[batch, seq, heads, K]``.
        v: ``[batch, seq, heads, V]``.
        g: ``[batch, seq, heads, K]`` log decay per key channel.
        beta: ``[batch, seq, heads]`` write strength in (0, 1).
        scale: query scale; ``K ** -0.5`` when None.
        initial_state: ``[batch, heads, K, V]`` or None (zeros).

    Returns:
        ``(o [batch, seq, heads, V] in v's dtype, final_state [batch, heads, K, V] float32)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.float()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t]  # [B, H, K]
        predicted = torch.einsum("bhkv,bhk->bhv", S, k_t)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - predicted)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), S
