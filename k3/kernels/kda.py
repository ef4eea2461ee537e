"""KDA core dispatch: one entry point, the best implementation for the device.

- CUDA with ``fla`` importable: fla's Triton kernels, ``fused_recurrent_kda`` for single-token decode and
  ``chunk_kda`` otherwise (flash-linear-attention 0.6.0 signatures, reference/dependencies.md §5).
- Everywhere else: the torch forms, the per-token recurrence for one token and the chunked form otherwise.

Every backend takes the same inputs: ``q``/``k`` already L2-normalised, ``g`` the log-space decay after the
gate function, ``beta`` after the sigmoid; the state is ``[batch, heads, K, V]`` float32 (fla's default
K-first layout, ``state_v_first=False``). The gate and the norms run in torch in the layer, so every backend
computes exactly the same function; fusing them into fla (``use_gate_in_kernel`` / ``safe_gate``) is a
GPU-side optimisation that must keep this contract.

Checked once on an H200 (torch 2.11, fla 0.6.0, Triton 3.6) against the torch chunked core: with float32 inputs
``fused_recurrent_kda`` agrees to 1e-7 and ``chunk_kda`` to 6e-4 (outputs) and 2e-3 (state), because fla's
chunk matmuls run in TF32; the tiny model's logits differed from the CPU float32 model by 4e-3.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from k3.kernels.kda_chunk import DEFAULT_CHUNK_SIZE, chunk_kda
from k3.kernels.kda_naive import naive_recurrent_kda

__all__ = ["kda_core", "fla_available", "Backend"]

Backend = Literal["auto", "torch_chunk", "torch_naive", "fla"]


@functools.cache
def _fla_ops():
    """``(chunk_kda, fused_recurrent_kda)`` from fla, or None when fla (or its Triton) cannot be imported."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
    except Exception:  # ImportError without fla; ModuleNotFoundError('triton') with fla but no Triton
        return None
    return fla_chunk_kda, fla_fused_recurrent_kda


def fla_available() -> bool:
    """True when fla's KDA kernels import (they also need a CUDA device to run)."""
    return _fla_ops() is not None


def kda_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    backend: Backend = "auto",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA delta-rule core.

    Args:
        q, k: ``[batch, seq, heads, K]`` L2-normalised. v: ``[batch, seq, heads, V]``.
        g: ``[batch, seq, heads, K]`` log decay (≤ 0). beta: ``[batch, seq, heads]`` in (0, 1).
        scale: query scale (``K ** -0.5`` when None). initial_state: ``[batch, heads, K, V]`` or None.
        backend: ``auto`` (fla on CUDA when importable, else torch), or force one implementation.
        chunk_size: chunk length of the torch chunked form.

    Returns:
        ``(o [batch, seq, heads, V] in v's dtype, final_state [batch, heads, K, V] float32)``.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"kda_core: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "q, k [batch, seq, heads, K] and v [batch, seq, heads, V]")
    if g.shape != q.shape or beta.shape != q.shape[:3]:
        raise ValueError(f"kda_core: g {tuple(g.shape)}, beta {tuple(beta.shape)}: expected g like q "
                         f"{tuple(q.shape)} and beta {tuple(q.shape[:3])}")
    B, T, H, K = q.shape
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"kda_core: initial_state {tuple(initial_state.shape)}: expected "
                         f"{(B, H, K, v.shape[-1])}")
    if backend == "auto":
        if q.is_cuda and fla_available():
            backend = "fla"
        else:
            backend = "torch_naive" if T == 1 else "torch_chunk"
    if backend == "torch_chunk":
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
    if backend == "torch_naive":
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    if backend == "fla":
        return _fla_core(q, k, v, g, beta, scale, initial_state)
    raise ValueError(f"kda_core: backend={backend!r}: expected one of auto, torch_chunk, torch_naive, fla")


def _fla_core(q, k, v, g, beta, scale, initial_state):
    ops = _fla_ops()
    if ops is None:
        raise RuntimeError("kda_core: backend='fla' needs flash-linear-attention with Triton "
                           "(pip install 'k3-lora-rl[gpu]') and a CUDA device")
    fla_chunk_kda, fla_fused_recurrent_kda = ops
    state = None if initial_state is None else initial_state.float().contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    q, k = q.to(v.dtype), k.to(v.dtype)  # the kernels take q, k, v in one dtype (the model's)
    if q.shape[1] == 1:
        o, final = fla_fused_recurrent_kda(
            q.contiguous(), k.contiguous(), v.contiguous(), g, beta,
            scale=scale, initial_state=state, output_final_state=True,
        )
    else:
        o, final = fla_chunk_kda(
            q.contiguous(), k.contiguous(), v.contiguous(), g, beta,
            scale=scale, initial_state=state, output_final_state=True,
        )
    return o.to(v.dtype), final.float()
