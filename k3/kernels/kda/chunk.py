"""KDA core in chunked form (WY representation / UT transform), plain torch: the CPU default.

Within a chunk of ``C`` tokens, with ``Γ_t = Σ_{i≤t} g_i`` (cumulative log decay from the chunk start) and
the state ``S₀`` at the chunk start, the delta rule of ``naive`` unrolls to

    u_t + Σ_{i<t} A_ti u_i = β_t (v_t − S₀ᵀ (e^{Γ_t} ⊙ k_t)),   A_ti = β_t Σ_d k_t[d] k_i[d] e^{Γ_t[d] − Γ_i[d]}

so ``U = (I + A)⁻¹ diag(β) (V − K̃ S₀) = Ū − W S₀`` with ``K̃ = e^{Γ} ⊙ K`` (one triangular solve per chunk, all
chunks at once). Then

    O   = (e^{Γ} ⊙ Q) S₀ + P U,                  P_ti = Σ_d q_t[d] k_i[d] e^{Γ_t[d] − Γ_i[d]}  (i ≤ t)
    S_C = Diag(e^{Γ_C}) S₀ + (e^{Γ_C − Γ} ⊙ K)ᵀ U

and only the short loop over chunks that carries ``S`` is sequential. The pairwise decays
``e^{Γ_t − Γ_i}`` inside ``A`` and ``P`` are formed as the product ``e^{Γ_t} · e^{−Γ_i}`` (two matmuls) when the
decay inside every chunk spans at most ``MAX_FACTORED_LOG_SPAN`` (always true for K3: a lower-bounded gate
≥ −5 over 16 tokens spans ≤ 80), and directly from differences otherwise, where no factor can overflow
however strong the decay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_kda", "intra_chunk_scores", "DEFAULT_CHUNK_SIZE", "MAX_FACTORED_LOG_SPAN"]

# With K3's gate (≥ −5 per token) a 16-token chunk always fits the factored form; measured fastest on CPU
# (docs/PERFORMANCE.md, bench/kda_cpu.py).
DEFAULT_CHUNK_SIZE = 16
# e^{80} ≈ 5.5e34 stays below float32's max (3.4e38) and e^{−80} ≈ 1.8e−35 above its smallest normal (1.2e−38),
# both with three orders of margin, so the factored products keep full relative precision.
MAX_FACTORED_LOG_SPAN = 80.0


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA core; same contract as ``naive_recurrent_kda``.

    Args:
        q, k: ``[batch, seq, heads, K]``, already L2-normalised.
        v: ``[batch, seq, heads, V]``.
        g: ``[batch, seq, heads, K]`` log decay (≤ 0).
        beta: ``[batch, seq, heads]``.
        scale: query scale; ``K ** -0.5`` when None.
        initial_state: ``[batch, heads, K, V]`` or None (zeros).
        chunk_size: tokens per chunk; any length works (the tail chunk is padded with no-op tokens).

    Returns:
        ``(o [batch, seq, heads, V] in v's dtype, final_state [batch, heads, K, V] float32)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: expected a positive integer")
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    if T == 0:
        return v.new_zeros(B, 0, H, V), S
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, D] -> [B, H, N, C, D]; padding tokens have k = v = q = 0, g = 0 (no decay), β = 0: no-ops.
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad))
        return x.view(B, N, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]

    G = g.cumsum(dim=-2)  # Γ_t, [B, H, N, C, K]
    q_decayed = G.exp() * q  # e^{Γ_t} ⊙ q_t
    k_decayed = G.exp() * k  # e^{Γ_t} ⊙ k_t
    KK, P = intra_chunk_scores(q, k, G, q_decayed, k_decayed)
    A = beta * KK

    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    rhs = torch.cat([beta * k_decayed, beta * v], dim=-1)
    solved = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    W, U_bar = solved[..., :K], solved[..., K:]
    G_end = G[..., -1:, :]  # [B, H, N, 1, K]
    k_to_end = (G_end - G).exp() * k  # e^{Γ_C − Γ_i} ⊙ k_i
    state_decay = G_end.exp().transpose(-1, -2)  # [B, H, N, K, 1]

    outs = []
    for n in range(N):
        U = U_bar[:, :, n] - W[:, :, n] @ S
        outs.append(q_decayed[:, :, n] @ S + P[:, :, n] @ U)
        S = state_decay[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), S


def intra_chunk_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    G: torch.Tensor,
    q_decayed: torch.Tensor,
    k_decayed: torch.Tensor,
    factored: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted key-key and query-key scores inside each chunk.

    Args:
        q, k: ``[.., C, K]`` chunked (q already scaled); G: ``[.., C, K]`` cumulative log decay in the chunk.
        q_decayed, k_decayed: ``e^{G} ⊙ q`` and ``e^{G} ⊙ k``.
        factored: force the factored (True) or pairwise (False) form; None picks factored when safe.

    Returns:
        ``KK [.., C, C]`` with ``KK[t, i] = Σ_d k_t k_i e^{Γ_t − Γ_i}`` for ``i < t`` (0 elsewhere) and
        ``P [.., C, C]`` with ``P[t, i] = Σ_d q_t k_i e^{Γ_t − Γ_i}`` for ``i ≤ t`` (0 elsewhere).
    """
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    if factored is None:
        # −Γ at the chunk's last token is the largest decay any pair in the chunk sees (g ≤ 0).
        factored = bool((-G[..., -1, :]).amax() <= MAX_FACTORED_LOG_SPAN) if G.numel() else True
    if factored:
        k_grown = (-G).exp() * k  # e^{−Γ_i} ⊙ k_i, at most e^{MAX_FACTORED_LOG_SPAN}
        KK = k_decayed @ k_grown.transpose(-1, -2)
        P = q_decayed @ k_grown.transpose(-1, -2)
    else:
        log_pair = G.unsqueeze(-2) - G.unsqueeze(-3)  # [.., t, i, K] = Γ_t − Γ_i
        pair_decay = log_pair.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()
        decayed_k = pair_decay * k.unsqueeze(-3)  # e^{Γ_t − Γ_i} ⊙ k_i at [.., t, i, :]
        KK = torch.einsum("...tid,...td->...ti", decayed_k, k)
        P = torch.einsum("...tid,...td->...ti", decayed_k, q)
    zero = KK.new_zeros(())
    return torch.where(causal.tril(-1), KK, zero), torch.where(causal, P, zero)
