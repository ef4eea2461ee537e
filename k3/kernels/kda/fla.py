"""KDA core dispatch: one entry point, the best implementation for the device (``kda_core``, ``kda_core_with_gate``).

- CUDA with ``fla`` importable: fla's Triton kernels, ``fused_recurrent_kda`` for decode (one token per
  sequence, no gradient needed: it has no backward) and ``chunk_kda`` otherwise (flash-linear-attention 0.6.0
  signatures, reference/dependencies.md §5).
- Everywhere else: the torch forms, the per-token recurrence for one token and the chunked form otherwise.

Every backend takes the same inputs: ``q``/``k`` already L2-normalised, ``g`` the log-space decay after the
gate function, ``beta`` after the sigmoid; the state is ``[batch, heads, K, V]`` float32 (fla's default
K-first layout, ``state_v_first=False``).

Packed sequences (``cu_seqlens``, FlashAttention's convention): ``batch`` is 1 and sequence ``n`` is tokens
``cu_seqlens[n]:cu_seqlens[n+1]``; no state crosses a boundary; the states are per sequence, ``[N, heads, K, V]``.

The gate (``kda_core_with_gate``): fla can compute the gate inside its kernels (``use_gate_in_kernel``). Its
gate is K3's — ``lower_bound · sigmoid(exp(A_log) · (z + dt_bias))`` with a bound (``fla/ops/kda/gate.py``,
``kda_gate_chunk_cumsum_vector_kernel``), ``-exp(A_log) · softplus(z + dt_bias)`` without — so only there is
fla's ``lower_bound`` passed: with pre-computed ``g`` fla 0.6.0 reads ``lower_bound`` nowhere in the math.
With a bound in fla's safe range ``[-5, 0)`` (K3: -5) the gate lies in ``(lower_bound, 0)`` and fla's
``safe_gate`` (bounded-gate TensorCore path of the intra-chunk kernel) computes the same function; for
pre-computed gates a caller that knows the bound says so with ``gate_lower_bound`` to get the same kernel.

Checked once on an H200 (torch 2.11, fla 0.6.0, Triton 3.6) against the torch chunked core: with float32 inputs
``fused_recurrent_kda`` agrees to 1e-7 and ``chunk_kda`` to 6e-4 (outputs) and 2e-3 (state), because fla's
chunk matmuls run in TF32; the tiny model's logits differed from the CPU float32 model by 4e-3.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Literal

import torch

from k3.kernels.kda.chunk import DEFAULT_CHUNK_SIZE, chunk_kda
from k3.kernels.kda.gate import kda_gate
from k3.kernels.kda.naive import naive_recurrent_kda
from k3.kernels.kda.tuning import pin_fla_configs, pinned_mode, use_covering_configs

__all__ = ["FLA_SAFE_GATE_RANGE", "Backend", "fla_available", "kda_core", "kda_core_with_gate"]

Backend = Literal["auto", "torch_chunk", "torch_naive", "fla"]

# fla 0.6.0 accepts safe_gate (with the fused gate) for lower bounds in [-5, 0) only (chunk.py).
FLA_SAFE_GATE_RANGE = (-5.0, 0.0)


@functools.cache
def _fla_ops():
    """``(chunk_kda, fused_recurrent_kda)`` from fla, or None when fla (or its Triton) cannot be imported."""
    pinned = None
    if torch.cuda.is_available():  # before fla's first import: it reads its config mode once
        major, minor = torch.cuda.get_device_capability(0)
        pinned = pin_fla_configs(torch.cuda.get_device_name(0), capability=f"{major}.{minor}")
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
    except Exception:  # noqa: BLE001 - ImportError without fla; ModuleNotFoundError('triton') without Triton
        return None
    if pinned is not None and pinned_mode() == "cover":
        use_covering_configs(importlib.import_module("fla.ops.utils.cache"))
    return fla_chunk_kda, fla_fused_recurrent_kda


def fla_available() -> bool:
    """True when fla's KDA kernels import (they also need a CUDA device to run)."""
    return _fla_ops() is not None


def _in_safe_range(lower_bound: float | None) -> bool:
    return lower_bound is not None and FLA_SAFE_GATE_RANGE[0] <= lower_bound < FLA_SAFE_GATE_RANGE[1]


# ------------------------------------------------------------------------------------------------ checks
def _check_core_inputs(q, k, v, g, beta, initial_state, n_states: int | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"kda_core: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "q, k [batch, seq, heads, K] and v [batch, seq, heads, V]")
    if g.shape != q.shape or beta.shape != q.shape[:3]:
        raise ValueError(f"kda_core: g {tuple(g.shape)}, beta {tuple(beta.shape)}: expected g like q "
                         f"{tuple(q.shape)} and beta {tuple(q.shape[:3])}")
    B, _, H, K = q.shape
    want = (B if n_states is None else n_states, H, K, v.shape[-1])
    if initial_state is not None and tuple(initial_state.shape) != want:
        per = "" if n_states is None else f" (one per packed sequence: {n_states})"
        raise ValueError(f"kda_core: initial_state {tuple(initial_state.shape)}: expected {want}{per}")


def _packed_bounds(cu_seqlens, batch: int, seq: int) -> torch.Tensor | None:
    """``cu_seqlens`` checked and as a CPU int64 tensor (None when not packed).

    A CUDA tensor costs one device sync here; pass a CPU tensor or a list to avoid it (it is copied to the
    device for fla).
    """
    if cu_seqlens is None:
        return None
    cu = torch.as_tensor(cu_seqlens).detach()
    if cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"kda_core: cu_seqlens {tuple(cu.shape)} {cu.dtype}: expected a 1-D integer tensor of "
                         "N + 1 sequence boundaries")
    cu = cu.to("cpu", torch.int64)
    if batch != 1:
        raise ValueError(f"kda_core: cu_seqlens needs the packed sequences flattened into batch 1, got batch {batch}")
    if int(cu[0]) != 0 or int(cu[-1]) != seq or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"kda_core: cu_seqlens {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}: expected "
                         f"non-decreasing boundaries from 0 to the {seq} tokens")
    return cu


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------------------------ core
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
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    gate_lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA delta-rule core.

    Args:
        q, k: ``[batch, seq, heads, K]`` L2-normalised. v: ``[batch, seq, heads, V]``.
        g: ``[batch, seq, heads, K]`` log decay (≤ 0). beta: ``[batch, seq, heads]`` in (0, 1).
        scale: query scale (``K ** -0.5`` when None). initial_state: ``[batch, heads, K, V]`` (``[N, heads, K, V]``
            with ``cu_seqlens``) or None.
        backend: ``auto`` (fla on CUDA when importable, else torch), or force one implementation.
        chunk_size: chunk length of the torch chunked form (fla uses its own, 64).
        cu_seqlens: ``[N + 1]`` boundaries of packed sequences in a batch of 1 (see the module docstring).
        gate_lower_bound: the caller guarantees ``g ≥ gate_lower_bound`` (g came from K3's bounded gate); inside
            fla's safe range it selects fla's bounded-gate kernel (``safe_gate``). The torch forms ignore it.

    Returns:
        ``(o [batch, seq, heads, V] in v's dtype, final_state [batch or N, heads, K, V] float32)``.
    """
    cu = _packed_bounds(cu_seqlens, q.shape[0], q.shape[1]) if q.dim() == 4 else None
    _check_core_inputs(q, k, v, g, beta, initial_state, None if cu is None else cu.numel() - 1)
    backend = _pick_backend(backend, q, cu)
    if backend == "fla":
        return _fla_core(q, k, v, g, beta, scale, initial_state, cu, safe_gate=_in_safe_range(gate_lower_bound))
    if backend in ("torch_chunk", "torch_naive"):
        return _torch_core(backend, q, k, v, g, beta, scale, initial_state, chunk_size, cu)
    raise ValueError(f"kda_core: backend={backend!r}: expected one of auto, torch_chunk, torch_naive, fla")


def _pick_backend(backend: Backend, q: torch.Tensor, cu: torch.Tensor | None) -> str:
    if backend != "auto":
        return backend
    if q.is_cuda and fla_available():
        return "fla"
    longest = q.shape[1] if cu is None else int((cu[1:] - cu[:-1]).max())
    return "torch_naive" if longest <= 1 else "torch_chunk"


def _torch_core(backend, q, k, v, g, beta, scale, initial_state, chunk_size, cu):
    def one(sl: slice, state):
        if backend == "torch_chunk":
            return chunk_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=scale,
                             initial_state=state, chunk_size=chunk_size)
        return naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=scale,
                                   initial_state=state)

    if cu is None:
        return one(slice(None), initial_state)
    outs, states = [], []
    for n in range(cu.numel() - 1):  # the reference: each sequence alone, from its own state
        o, s = one(slice(int(cu[n]), int(cu[n + 1])), None if initial_state is None else initial_state[n:n + 1])
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


def _fla_inputs(q, k, v, beta, initial_state, cu):
    """What every fla call takes: q, k, v in one dtype (the model's), beta and the state in float32."""
    dtype = v.dtype
    state = None if initial_state is None else initial_state.float().contiguous()
    cu_dev = None if cu is None else cu.to(q.device, non_blocking=True)
    return (q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.contiguous(), beta.float().contiguous(),
            state, cu_dev)


def _require_fla():
    ops = _fla_ops()
    if ops is None:
        raise RuntimeError("kda_core: backend='fla' needs flash-linear-attention with Triton "
                           "(pip install 'k3-lora-rl[gpu]') and a CUDA device")
    return ops


def _use_fused_recurrent(q, cu, *tensors) -> bool:
    longest = q.shape[1] if cu is None else int((cu[1:] - cu[:-1]).max())
    return longest == 1 and not _needs_grad(*tensors)


def _fla_core(q, k, v, g, beta, scale, initial_state, cu, safe_gate: bool):
    fla_chunk_kda, fla_fused_recurrent_kda = _require_fla()
    decode = _use_fused_recurrent(q, cu, q, k, v, g, beta, initial_state)
    qc, kc, vc, betac, state, cu_dev = _fla_inputs(q, k, v, beta, initial_state, cu)
    g = g.float().contiguous()
    if decode:
        o, final = fla_fused_recurrent_kda(qc, kc, vc, g, betac, scale=scale, initial_state=state,
                                           output_final_state=True, cu_seqlens=cu_dev)
    else:
        o, final = fla_chunk_kda(qc, kc, vc, g, betac, scale=scale, initial_state=state, output_final_state=True,
                                 safe_gate=safe_gate, cu_seqlens=cu_dev, cu_seqlens_cpu=cu)
    return o.to(v.dtype), final.float()


# ------------------------------------------------------------------------------------------------ with the gate
def kda_core_with_gate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    backend: Backend = "auto",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_core(q, k, v, kda_gate(z, A_log, dt_bias, lower_bound), beta, ...)``, the gate fused on fla.

    Args:
        z: ``[batch, seq, heads, K]`` raw gate logit (``f_b(f_a x)``); A_log ``[heads]``; dt_bias ``[heads * K]``.
        lower_bound: K3's ``gate_lower_bound`` (negative) or None for the softplus form.
        Others as ``kda_core``.

    Returns:
        As ``kda_core``. Gradients reach ``z``, ``A_log`` and ``dt_bias`` on every backend.
    """
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"kda_core_with_gate: lower_bound={lower_bound}: expected a negative bound or None")
    heads, K = q.shape[-2:] if q.dim() == 4 else (-1, -1)
    if tuple(A_log.shape) != (heads,) or tuple(dt_bias.shape) != (heads * K,):
        raise ValueError(f"kda_core_with_gate: A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}, q "
                         f"{tuple(q.shape)}: expected q [batch, seq, heads, K], A_log [heads], dt_bias [heads * K]")
    cu = _packed_bounds(cu_seqlens, q.shape[0], q.shape[1])
    _check_core_inputs(q, k, v, z, beta, initial_state, None if cu is None else cu.numel() - 1)
    backend = _pick_backend(backend, q, cu)
    if backend != "fla":
        g = kda_gate(z, A_log, dt_bias, lower_bound)
        return kda_core(q, k, v, g, beta, scale, initial_state, backend, chunk_size, cu_seqlens=cu)
    fla_chunk_kda, fla_fused_recurrent_kda = _require_fla()
    decode = _use_fused_recurrent(q, cu, q, k, v, z, beta, initial_state, A_log, dt_bias)
    qc, kc, vc, betac, state, cu_dev = _fla_inputs(q, k, v, beta, initial_state, cu)
    gate = {"use_gate_in_kernel": True, "A_log": A_log.float().contiguous(),
            "dt_bias": dt_bias.float().contiguous(), "lower_bound": lower_bound}
    z = z.float().contiguous()
    if decode:
        o, final = fla_fused_recurrent_kda(qc, kc, vc, z, betac, scale=scale, initial_state=state,
                                           output_final_state=True, cu_seqlens=cu_dev, **gate)
    else:
        o, final = fla_chunk_kda(qc, kc, vc, z, betac, scale=scale, initial_state=state, output_final_state=True,
                                 safe_gate=_in_safe_range(lower_bound), cu_seqlens=cu_dev, cu_seqlens_cpu=cu,
                                 **gate)
    return o.to(v.dtype), final.float()
