"""flashinfer: every call the project makes into it — paged MLA decode and top-p sampling (optional import).

Written against ``flashinfer-python==0.6.15.post1`` (the ``gpu`` extra's pin), using only these signatures:

    flashinfer.mla.BatchMLAPagedAttentionWrapper(float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,
                                                kv_indptr=None, kv_indices=None, kv_len_arr=None)
        .plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
              causal, sm_scale, q_data_type, kv_data_type)
        .run(q_nope [b, h, ckv], q_pe [b, h, kpe], ckv_cache [pages, P, ckv], kpe_cache [pages, P, kpe]) -> [b, h, ckv]
    flashinfer.sampling.top_p_sampling_from_probs(probs, top_p, deterministic=True, generator=None) -> int32 [b]

The MLA kernel is the absorbed form (``k3.kernels.mla_decode.naive`` computes the same from a paged cache in
``mla_decode_paged_reference``): ``q_nope`` is the query already multiplied by W_UK, the output is still to be
multiplied by W_UV. Request i reads its first ``kv_len[i]`` tokens from the pages ``kv_indices[kv_indptr[i]:]``;
the kernel reads ``kv_indptr[i]`` only as where request i's pages start, so a request may list more pages than its
length uses (measured facts of the kernel and the JIT cost: issue #21).

``plan`` runs on the host and hands its schedule to the device through one page-locked buffer, copied
asynchronously; a second ``plan`` before that copy ran would overwrite it. So each plan waits for the previous
plan's copy (a CUDA event recorded after it): the host never runs more than one step ahead of the device here.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["FLASHINFER_PIN", "WORKSPACE_BYTES", "MLA_HEAD_DIMS", "PagedMLADecode", "flashinfer_available",
           "flashinfer_missing", "mla_shape_problem", "top_p_sample"]

FLASHINFER_PIN = "flashinfer-python==0.6.15.post1"
WORKSPACE_BYTES = 128 * 2**20  # flashinfer's recommended float workspace (split-k partial results)
# (head_dim_ckv, head_dim_kpe) that flashinfer's MLA kernels are instantiated for: the DeepSeek / K3 shape. Any other
# JIT-compiles for minutes and then fails inside the Hopper kernel's wgmma templates (seen on the H200 for the tiny
# variant's (16, 8)), so it is refused before any build.
MLA_HEAD_DIMS = ((512, 64),)


@functools.cache
def _import() -> tuple[Any | None, str | None]:
    """``(flashinfer, None)``, or ``(None, why not)``."""
    try:
        import flashinfer  # noqa: F401
        import flashinfer.mla
        import flashinfer.sampling
    except Exception as e:  # noqa: BLE001 - ImportError without it; anything its import raises on a broken install
        return None, f"flashinfer does not import ({type(e).__name__}: {e}); pip install '{FLASHINFER_PIN}'"
    return flashinfer, None


def flashinfer_missing(device: torch.device | str | None = None) -> str | None:
    """Why flashinfer cannot run here (None when it can): not importable, or ``device`` is not a CUDA device."""
    if device is not None and torch.device(device).type != "cuda":
        return f"flashinfer needs a CUDA device, the engine runs on {torch.device(device)}"
    return _import()[1]


def flashinfer_available(device: torch.device | str | None = None) -> bool:
    return flashinfer_missing(device) is None


def mla_shape_problem(head_dim_ckv: int, head_dim_kpe: int) -> str | None:
    """Why flashinfer's MLA kernel cannot take this latent shape (None when it can)."""
    if (head_dim_ckv, head_dim_kpe) in MLA_HEAD_DIMS:
        return None
    known = ", ".join(f"({c}, {k})" for c, k in MLA_HEAD_DIMS)
    return (f"flashinfer's MLA kernel is built for (kv_lora_rank, qk_rope_head_dim) {known} only, the model has "
            f"({head_dim_ckv}, {head_dim_kpe})")


def _require() -> Any:
    module, why = _import()
    if module is None:
        raise RuntimeError(why)
    return module


class PagedMLADecode:
    """flashinfer's ``BatchMLAPagedAttentionWrapper`` for decode (one query token per request).

    Args:
        device: a CUDA device. num_heads, head_dim_ckv, head_dim_kpe: the MLA shape (K3: 96, 512, 64).
        page_size: tokens per page of the caches given to ``run``.
        max_batch, max_pages: sizes of the fixed index buffers (``use_cuda_graph`` only: the wrapper then serves
            exactly ``max_batch`` requests, and a captured ``run`` reads the plan from those buffers).
        workspace: the float workspace (``WORKSPACE_BYTES`` uint8) to share between wrappers that never run at
            once; a new one when None.
    """

    def __init__(self, device: torch.device | str, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
                 page_size: int, *, max_batch: int = 0, max_pages: int = 0, use_cuda_graph: bool = False,
                 workspace: torch.Tensor | None = None) -> None:
        fi = _require()
        shape_problem = mla_shape_problem(head_dim_ckv, head_dim_kpe)
        if shape_problem is not None:
            raise ValueError(f"PagedMLADecode: {shape_problem}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"PagedMLADecode: device {self.device}: flashinfer runs on CUDA only")
        self.num_heads, self.head_dim_ckv, self.head_dim_kpe, self.page_size = (num_heads, head_dim_ckv,
                                                                                 head_dim_kpe, page_size)
        self.workspace = (workspace if workspace is not None
                          else torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device))
        self.use_cuda_graph = use_cuda_graph
        self.max_batch = max_batch
        if use_cuda_graph:
            if max_batch < 1 or max_pages < 1:
                raise ValueError("PagedMLADecode: use_cuda_graph needs max_batch and max_pages")
            i32 = dict(dtype=torch.int32, device=self.device)
            self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(
                self.workspace, use_cuda_graph=True, qo_indptr=torch.zeros(max_batch + 1, **i32),
                kv_indptr=torch.zeros(max_batch + 1, **i32), kv_indices=torch.zeros(max_pages, **i32),
                kv_len_arr=torch.zeros(max_batch, **i32))
        else:
            self.wrapper = fi.mla.BatchMLAPagedAttentionWrapper(self.workspace)
        self._planned: torch.cuda.Event | None = None

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor, sm_scale: float,
             dtype: torch.dtype) -> None:
        """Plan the next ``run`` calls (every layer of one step shares a plan).

        Args:
            kv_indptr: ``[b + 1]`` int32 on the host: where each request's pages start in ``kv_indices``.
            kv_indices: int32 page ids on the device (static between plans: no host-to-device copy then).
            kv_len: ``[b]`` int32 on the host: tokens each request attends to (≥ 1).
            sm_scale: softmax scale (the head dim before absorption: ``(nope + rope) ** -0.5``).
            dtype: of the query and of the caches.
        """
        b = kv_len.shape[0]
        if kv_indptr.device.type != "cpu" or kv_len.device.type != "cpu":
            raise ValueError("PagedMLADecode.plan: kv_indptr and kv_len must be host tensors (the plan is made on "
                             "the host; device ones would be read back, a sync per step)")
        if kv_indptr.shape[0] != b + 1:
            raise ValueError(f"PagedMLADecode.plan: kv_indptr has {kv_indptr.shape[0]} entries, expected {b + 1}")
        if self.use_cuda_graph and b != self.max_batch:
            raise ValueError(f"PagedMLADecode.plan: {b} requests, this graph-mode wrapper serves {self.max_batch}")
        if self._planned is not None:
            self._planned.synchronize()  # the previous plan's page-locked buffer has reached the device
        qo_indptr = torch.arange(b + 1, dtype=torch.int32)
        self.wrapper.plan(qo_indptr, kv_indptr.to(torch.int32), kv_indices, kv_len.to(torch.int32), self.num_heads,
                          self.head_dim_ckv, self.head_dim_kpe, self.page_size, False, sm_scale, dtype, dtype)
        self._planned = torch.cuda.Event()
        self._planned.record()

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_pages: torch.Tensor,
            kpe_pages: torch.Tensor) -> torch.Tensor:
        """``q_nope [b, h, ckv]`` (absorbed), ``q_pe [b, h, kpe]``, caches ``[pages, page_size, ·]``
        -> ``[b, h, ckv]``."""
        return self.wrapper.run(q_nope.contiguous(), q_pe.contiguous(), ckv_pages, kpe_pages)


def top_p_sample(probs: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``probs [b, vocab]`` (float32, rows summing to 1) within the top-``top_p`` mass
    (flashinfer's rejection sampler, deterministic mode) -> ``[b]`` int64."""
    fi = _require()
    return fi.sampling.top_p_sampling_from_probs(probs.float(), top_p, deterministic=True,
                                                  generator=generator).long()
