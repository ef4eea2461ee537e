"""The window decode's MLA attention on flashinfer's paged kernel, over a ``StaticK3Cache`` as it lies.

The static cache keeps row b's tokens at columns ``f_b … max_len − 1`` of its ``[rows, max_len, ·]`` latents
(``f_b``: the row's first real column; left padding before it). Seen as token-granular pages (page size 1:
``ckv.reshape(rows · max_len, 1, 512)``, a view), row b's pages are ``b · max_len + f_b, b · max_len + f_b + 1, …``,
so the padding is skipped without moving a byte: ``kv_indptr``/``kv_indices`` are fixed for the whole batch and
only the lengths (``seen − f_b``, known on the host) change per step, planned once per step for every MLA layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.kernels.mla_decode.flashinfer import PagedMLADecode

__all__ = ["FlashInferWindowAttention"]


class FlashInferWindowAttention:
    """A ``k3.model.mla.MLADecodeAttention`` on ``PagedMLADecode`` (page size 1) for batches of static-cache rows.

    Args:
        device: the CUDA device. num_heads, kv_lora_rank, rope_dim, scale: the model's MLA shape and softmax scale.
        max_len: the static cache's ``max_len`` (columns per row).
        graph_rows: for a CUDA graph, the fixed batch this attention serves (its index buffers are sized for it);
            0 for eager use at any batch size.
        workspace: a float workspace to share (``k3.kernels.mla_decode.flashinfer.WORKSPACE_BYTES``).
    """

    def __init__(self, device: torch.device, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 max_len: int, dtype: torch.dtype, graph_rows: int = 0,
                 workspace: torch.Tensor | None = None) -> None:
        self.device, self.max_len, self.scale, self.dtype = device, max_len, scale, dtype
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.kernel = PagedMLADecode(device, num_heads, kv_lora_rank, rope_dim, page_size=1,
                                     max_batch=graph_rows, max_pages=graph_rows * max_len,
                                     use_cuda_graph=graph_rows > 0, workspace=workspace)
        self.probed = False  # whether one eager step ran on it (the engine's check that flashinfer runs here)
        self._first: list[int] = []
        self._indptr: torch.Tensor | None = None
        self._indices: torch.Tensor | None = None

    def begin_batch(self, first_real: Sequence[int]) -> None:
        """Fix the pages of a batch: row b's first real column ``first_real[b]`` (one host→device copy)."""
        T = self.max_len
        if any(not 0 <= f < T for f in first_real):
            raise ValueError(f"FlashInferWindowAttention: first real columns {list(first_real)[:8]} outside "
                             f"[0, {T})")
        self._first = list(first_real)
        spans = [T - f for f in self._first]
        self._indptr = torch.tensor([0, *spans], dtype=torch.int32).cumsum(0).to(torch.int32)
        self._indices = torch.cat([torch.arange(b * T + f, (b + 1) * T, dtype=torch.int32)
                                   for b, f in enumerate(self._first)]).to(self.device)

    def plan_step(self, seen: int) -> None:
        """Plan the next step, after which each row holds ``seen`` columns (the step's own token included)."""
        if self._indptr is None:
            raise RuntimeError("FlashInferWindowAttention.plan_step before begin_batch")
        lens = torch.tensor([seen - f for f in self._first], dtype=torch.int32)
        self.kernel.plan(self._indptr, self._indices, lens, self.scale, self.dtype)

    def __call__(self, q_latent: torch.Tensor, q_rope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                 valid: torch.Tensor, scale: float) -> torch.Tensor:
        """As ``mla_decode_masked``; ``valid`` is not read (the plan holds the lengths)."""
        pages = ckv.shape[0] * ckv.shape[1]
        return self.kernel.run(q_latent, q_rope, ckv.reshape(pages, 1, self.kv_lora_rank),
                               kpe.reshape(pages, 1, self.rope_dim))
