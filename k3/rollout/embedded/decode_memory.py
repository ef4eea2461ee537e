"""What the embedded engine keeps on its device between ``generate`` calls: the static decode cache (memory tag
``kv_cache``, with flashinfer's workspace and index buffers) and the CUDA graphs captured over it (``cuda_graph``).

One ``StaticK3Cache`` sized for the largest batch and length asked so far (lengths rounded up to
``CACHE_LEN_MULTIPLE``) serves every batch through a rows view; it grows when a call needs more, which drops the
graphs captured over the old one. Releasing ``kv_cache`` frees the cache and everything that points into it (the
graphs too); resuming it allocates the cache again at its last size. Releasing ``cuda_graph`` frees the graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from k3.kernels.mla_decode.flashinfer import WORKSPACE_BYTES
from k3.model import KimiK3ForCausalLM
from k3.model.cache import StaticK3Cache, StaticMLALayerState
from k3.model.mla import MLADecodeAttention
from k3.rollout.embedded.cuda_graph import DecodeGraph
from k3.rollout.embedded.flashinfer_attention import FlashInferWindowAttention

__all__ = ["CACHE_LEN_MULTIPLE", "DecodeMemory"]

log = logging.getLogger(__name__)

# Cache lengths are rounded up to this (tokens): a few prompt tokens more do not re-allocate the cache and re-capture.
CACHE_LEN_MULTIPLE = 256


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class DecodeMemory:
    """The engine's static cache, its rows views, its CUDA graphs and its flashinfer attentions."""

    def __init__(self, model: KimiK3ForCausalLM, device: torch.device) -> None:
        self.model, self.device = model, device
        self.cache: StaticK3Cache | None = None
        self._size: tuple[int, int] | None = None  # (rows, max_len) of the last cache, for resume
        self._views: dict[int, StaticK3Cache] = {}
        self._graphs: dict[tuple[int, str], DecodeGraph] = {}
        self._pool: tuple[int, int] | None = None
        self._workspace: torch.Tensor | None = None
        self._flashinfer: dict[int, FlashInferWindowAttention] = {}  # by graph rows; 0: the eager one

    # ------------------------------------------------------------------ the cache
    def rows(self, n: int, length: int) -> StaticK3Cache:
        """An emptied view of ``n`` rows of a cache of at least ``length`` tokens (grown if needed)."""
        if self.cache is None or n > self.cache.batch_size or length > self.cache.max_len:
            rows = max(n, self.cache.batch_size if self.cache is not None else 0)
            max_len = max(_round_up(length, CACHE_LEN_MULTIPLE), self.cache.max_len if self.cache is not None else 0)
            self._allocate(rows, max_len)
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.cache.rows(n)
        view.reset()
        return view

    def _allocate(self, rows: int, max_len: int) -> None:
        self.release_cache()
        self.cache = self.model.init_static_cache(rows, max_len)
        self._size = (rows, max_len)

    def latent_dtype(self) -> torch.dtype:
        """The dtype of the cached MLA latents (the model's)."""
        return next(s.ckv.dtype for s in self.cache.layers if isinstance(s, StaticMLALayerState))

    # ------------------------------------------------------------------ what reads the cache
    def flashinfer_attention(self, graph_rows: int = 0) -> FlashInferWindowAttention:
        """flashinfer's MLA attention over the cache (``graph_rows``: for a graph of that many rows; 0: eager)."""
        if self.cache is None:
            raise RuntimeError("DecodeMemory.flashinfer_attention before the cache exists")
        att = self._flashinfer.get(graph_rows)
        if att is None:
            if self._workspace is None:
                self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            cfg = self.model.config
            att = FlashInferWindowAttention(self.device, cfg.num_attention_heads, cfg.kv_lora_rank,
                                            cfg.qk_rope_head_dim, cfg.qk_head_dim**-0.5, self.cache.max_len,
                                            self.latent_dtype(), graph_rows=graph_rows, workspace=self._workspace)
            self._flashinfer[graph_rows] = att
        return att

    def graph(self, n: int, kind: str, attention: MLADecodeAttention,
              prepare: Callable[[], None] | None = None) -> DecodeGraph:
        """The captured step for the ``n``-row view and attention ``kind`` (captured on first use; ``prepare``
        runs before capturing, e.g. a flashinfer plan). Raises whatever the capture raises."""
        g = self._graphs.get((n, kind))
        if g is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            if prepare is not None:
                prepare()
            g = self._graphs[(n, kind)] = DecodeGraph(self.model, self._views[n], attention, self._pool)
        return g

    # ------------------------------------------------------------------ release / resume
    def release(self, tags: Sequence[str]) -> None:
        """Free ``kv_cache`` (the cache, its views, graphs and flashinfer state) and/or ``cuda_graph``."""
        if "kv_cache" in tags:
            self.release_cache()
        if "cuda_graph" in tags:
            self.release_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, tags: Sequence[str]) -> None:
        """``kv_cache``: allocate the cache again at its last size (graphs are captured again on first use)."""
        if "kv_cache" in tags and self.cache is None and self._size is not None:
            self._allocate(*self._size)

    def release_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None

    def release_cache(self) -> None:
        self.release_graphs()
        self._flashinfer.clear()
        self._workspace = None
        self._views.clear()
        self.cache = None

    def nbytes(self) -> int:
        """Bytes of the static cache (0 when released)."""
        return 0 if self.cache is None else self.cache.nbytes()
