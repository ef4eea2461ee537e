"""MLA decode attention in the latent space, in plain torch.

For one query token per sequence, with ``q_latent = q_nope · W_UK`` (the absorbed query) and per cached token t
the normed latent ``ckv_t`` and shared key ``kpe_t``:

    s_t = scale · (q_latent · ckv_t + q_rope · kpe_t)        per head
    o   = Σ_t softmax(s)_t · ckv_t                             [heads, kv_lora_rank], before W_UV

Scores and the softmax run in float32 (float64 for a float64 cache); the two products with the cache run in the
cache's dtype with float32 accumulation (as a GEMM does), so a BF16 cache is never widened in memory.
"""

from __future__ import annotations

import torch

__all__ = ["mla_decode_masked", "mla_decode_paged_reference"]


def _check_query(q_latent: torch.Tensor, q_rope: torch.Tensor, C: int, R: int) -> None:
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"mla_decode: q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}: expected "
                         "[batch, heads, kv_lora_rank] and [batch, heads, rope] with the same batch and heads")
    if q_latent.shape[-1] != C or q_rope.shape[-1] != R:
        raise ValueError(f"mla_decode: query widths {q_latent.shape[-1]} + {q_rope.shape[-1]} do not match the "
                         f"cache's {C} + {R}")


def mla_decode_masked(q_latent: torch.Tensor, q_rope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                      valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Latent attention over a dense cache window.

    Args:
        q_latent: ``[b, h, C]`` absorbed query. q_rope: ``[b, h, R]``.
        ckv: ``[b, T, C]`` normed latents. kpe: ``[b, T, R]``.
        valid: ``[b, T]`` bool, True for the keys each row attends to (every row needs one).
        scale: softmax scale (``(nope + rope) ** -0.5``).

    Returns:
        ``[b, h, C]`` in ckv's dtype.
    """
    b, T, C = ckv.shape
    R = kpe.shape[-1]
    _check_query(q_latent, q_rope, C, R)
    if kpe.shape[:2] != (b, T) or valid.shape != (b, T) or q_latent.shape[0] != b:
        raise ValueError(f"mla_decode_masked: ckv {tuple(ckv.shape)}, kpe {tuple(kpe.shape)}, valid "
                         f"{tuple(valid.shape)}, q batch {q_latent.shape[0]}: expected ckv [b, T, C], kpe [b, T, R], "
                         "valid [b, T]")
    dtype = ckv.dtype
    acc = torch.promote_types(dtype, torch.float32)  # float32, or float64 for a float64 cache
    scores = torch.bmm(q_latent.to(dtype), ckv.transpose(1, 2)).to(acc)  # [b, h, T]
    scores = scores + torch.bmm(q_rope.to(dtype), kpe.transpose(1, 2)).to(acc)
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.bmm(p.to(dtype), ckv)


def mla_decode_paged_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, ckv_pages: torch.Tensor,
                               kpe_pages: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                               kv_len: torch.Tensor, scale: float) -> torch.Tensor:
    """Latent attention over a paged cache, one request at a time (flashinfer's layout; the test oracle).

    Request ``i`` reads its first ``kv_len[i]`` tokens from the pages ``kv_indices[kv_indptr[i]:]`` in order:
    token j sits in page ``kv_indices[kv_indptr[i] + j // P]`` at slot ``j % P`` (P = page size).

    Args:
        q_latent: ``[b, h, C]``; q_rope ``[b, h, R]``.
        ckv_pages: ``[pages, P, C]``; kpe_pages ``[pages, P, R]``.
        kv_indptr: ``[b + 1]`` int; kv_indices ``[≥ kv_indptr[-1]]`` int; kv_len ``[b]`` int, ≥ 1.
        scale: softmax scale.

    Returns:
        ``[b, h, C]`` in ckv's dtype.
    """
    pages, P, C = ckv_pages.shape
    R = kpe_pages.shape[-1]
    _check_query(q_latent, q_rope, C, R)
    b = q_latent.shape[0]
    indptr, indices, lens = (t.to("cpu", torch.int64).tolist() for t in (kv_indptr, kv_indices, kv_len))
    if len(indptr) != b + 1 or len(lens) != b:
        raise ValueError(f"mla_decode_paged_reference: kv_indptr has {len(indptr)} entries, kv_len {len(lens)}: "
                         f"expected {b + 1} and {b}")
    out = []
    for i in range(b):
        n = lens[i]
        need = -(-n // P)
        if n < 1 or indptr[i] + need > len(indices):
            raise ValueError(f"mla_decode_paged_reference: request {i}: kv_len {n} needs {need} pages from "
                             f"kv_indptr {indptr[i]}, kv_indices has {len(indices)}")
        page_ids = torch.tensor(indices[indptr[i]:indptr[i] + need], device=ckv_pages.device)
        ckv = ckv_pages[page_ids].reshape(need * P, C)[:n]
        kpe = kpe_pages[page_ids].reshape(need * P, R)[:n]
        valid = torch.ones(1, n, dtype=torch.bool, device=ckv.device)
        out.append(mla_decode_masked(q_latent[i:i + 1], q_rope[i:i + 1], ckv[None], kpe[None], valid, scale))
    return torch.cat(out)
