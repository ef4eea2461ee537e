"""Packed sequences (megatron's THD format) for K3 on the megatron backend: the layout, and what KDA and MLA need.

**The layout.** A packed micro-batch holds ``N`` sequences back to back in one row: ``input_ids [1, T]``,
sequence ``n`` is tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` (FlashAttention's convention, int64, on the host).
Megatron carries the boundaries to every layer as ``packed_seq_params`` (``qkv_format="thd"``); the trainer
(``k3.megatron.training``) builds them with :func:`packed_seq_params`, which also keeps a host copy of the bounds
(:class:`K3PackedSeqParams`), so no layer syncs with the device to read them. Under context parallelism the
bounds are the whole sequences' (megatron's convention: this rank holds ``1 / cp`` of every sequence, see
``k3.megatron.context_parallel``).

**What depends on the boundaries** — the only parts of K3 that mix tokens:

- KDA's short causal convolutions: each sequence starts from a zero history (:func:`packed_causal_conv`);
- KDA's delta-rule core: the state restarts at each boundary (``k3.kernels.kda.fla.kda_core`` with
  ``cu_seqlens``: fla's varlen kernels on CUDA, the torch forms per sequence elsewhere);
- MLA's softmax attention: causal within each sequence (:func:`packed_causal_attention`).

**What does not.** The embedding, the norms, the AttnRes mixes (a mix over depth: each bank row and the partial
sum are per-token tensors, a mix never reads another token), the dense MLP and the latent MoE (routing and experts
are per token; megatron's dispatcher is dropless, so no token competes with another for capacity), the LoRA deltas,
the LM head and the per-token loss. K3 has no positional encoding at all (NoPE MLA, ``position_embedding_type
"none"``), so there are no rotary positions to restart per sequence; the only positional signal is causality,
which the three parts above keep per sequence.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

__all__ = [
    "K3PackedSeqParams",
    "check_bounds",
    "packed_causal_attention",
    "packed_causal_conv",
    "packed_seq_params",
    "segment_ids",
    "sequence_bounds",
]

AttentionBackend = Literal["auto", "varlen", "sequences"]


@dataclass
class K3PackedSeqParams(PackedSeqParams):
    """megatron's ``PackedSeqParams`` plus ``cu_seqlens_cpu``: the same bounds as ``cu_seqlens_q`` (int64, host),
    read by K3's layers without a device sync."""

    cu_seqlens_cpu: torch.Tensor | None = None


def check_bounds(cu_seqlens: torch.Tensor | list[int], total: int | None = None, what: str = "cu_seqlens"
                 ) -> torch.Tensor:
    """``cu_seqlens`` as a host int64 tensor ``[N + 1]``, checked: starts at 0, non-decreasing, ends at ``total``
    (when given). ``ValueError`` names what is wrong."""
    cu = torch.as_tensor(cu_seqlens).detach()
    if cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{what} {tuple(cu.shape)} {cu.dtype}: expected a 1-D integer tensor of N + 1 sequence "
                         "boundaries")
    cu = cu.to("cpu", torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or (total is not None and int(cu[-1]) != total):
        end = "" if total is None else f" to the {total} tokens"
        raise ValueError(f"{what} {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}: expected non-decreasing "
                         f"boundaries from 0{end}")
    return cu


def packed_seq_params(cu_seqlens: torch.Tensor | list[int], device: torch.device | str) -> K3PackedSeqParams:
    """megatron's THD parameters for the packed sequences ``cu_seqlens`` (``[N + 1]``, whole sequences): int32
    bounds on ``device`` (what megatron's own attention kernels take) and the int64 host copy."""
    cu = check_bounds(cu_seqlens)
    on_device = cu.to(device=device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return K3PackedSeqParams(qkv_format="thd", cu_seqlens_q=on_device, cu_seqlens_kv=on_device,
                             max_seqlen_q=longest, max_seqlen_kv=longest, cu_seqlens_cpu=cu)


def sequence_bounds(params: PackedSeqParams | None) -> torch.Tensor | None:
    """The host int64 bounds of megatron's ``packed_seq_params`` (None when not packed). A plain
    ``PackedSeqParams`` (not built by :func:`packed_seq_params`) costs one device sync here."""
    if params is None:
        return None
    if params.qkv_format != "thd":
        raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r}: K3 packs sequences as 'thd'")
    if params.cu_seqlens_q_padded is not None and not torch.equal(params.cu_seqlens_q_padded, params.cu_seqlens_q):
        raise ValueError("packed_seq_params: padded bounds (cu_seqlens_q_padded) other than cu_seqlens_q are not "
                         "supported; pad inside each sequence instead")
    cu = getattr(params, "cu_seqlens_cpu", None)
    return check_bounds(params.cu_seqlens_q if cu is None else cu, what="packed_seq_params.cu_seqlens_q")


def segment_ids(cu_seqlens: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """``[T]`` int64: the sequence index of every token of the packed stream."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)


# ---------------------------------------------------------------------------------------------- KDA short convs
def packed_causal_conv(x: torch.Tensor, conv: torch.nn.Module, cu_seqlens: torch.Tensor,
                       history: torch.Tensor | None = None) -> torch.Tensor:
    """``conv`` (a ``k3.model.kda.CausalConv1d``) over each packed sequence on its own.

    Args:
        x: ``[1, T, channels]`` the packed inputs.
        cu_seqlens: ``[N + 1]`` host int64 bounds (:func:`check_bounds`).
        history: ``[N, channels, kernel − 1]`` the inputs before each sequence (context parallelism's halos), or
            None: every sequence starts from zeros, exactly as when it runs alone.

    Returns:
        ``[1, T, channels]`` float32, as ``conv(x_n, history_n)`` per sequence ``n``.

    One convolution over the stream with ``kernel − 1`` history slots before every sequence: token ``t`` of
    sequence ``n`` sits at slot ``t + (n + 1)(kernel − 1)``, so its window reaches its own sequence and that
    sequence's history slots, never the tokens before them.
    """
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"packed_causal_conv: x {tuple(x.shape)}: expected [1, tokens, channels]")
    T, C = x.shape[1], x.shape[2]
    cu = check_bounds(cu_seqlens, T, "packed_causal_conv: cu_seqlens")
    n, k1 = cu.numel() - 1, conv.kernel_size - 1
    if history is not None and tuple(history.shape) != (n, C, k1):
        raise ValueError(f"packed_causal_conv: history {tuple(history.shape)}: expected ({n}, {C}, {k1}) (sequences, "
                         "channels, kernel - 1)")
    device = x.device
    seg = segment_ids(cu, device)
    slot = torch.arange(T, device=device) + (seg + 1) * k1
    stream = x.new_zeros((C, T + n * k1), dtype=torch.float32).index_copy(1, slot, x[0].float().t())
    if history is not None and k1:
        starts = (cu[:-1] + torch.arange(n) * k1).to(device)  # the first history slot of each sequence
        slots = (starts.unsqueeze(1) + torch.arange(k1, device=device)).reshape(-1)
        stream = stream.index_copy(1, slots, history.float().permute(1, 0, 2).reshape(C, n * k1))
    y = F.conv1d(stream.unsqueeze(0), conv.weight, groups=C)[0]  # [C, T + (n − 1)(k − 1)]: valid windows only
    return y.index_select(1, slot - k1).t().unsqueeze(0)


# ---------------------------------------------------------------------------------------------- MLA core
def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            cu_seqlens: torch.Tensor, backend: AttentionBackend = "auto") -> torch.Tensor:
    """Causal softmax attention within each packed sequence.

    Args:
        q, k: ``[1, heads, T, dk]``; v: ``[1, heads, T, dv]`` (``dv`` may differ from ``dk``, as in MLA).
        cu_seqlens: ``[N + 1]`` host int64 bounds.
        backend: ``varlen`` — torch's FlashAttention varlen kernel (``torch.nn.attention.varlen``; CUDA, BF16/FP16,
            v zero-padded to ``dk``: the padded output columns are exactly zero and are dropped); ``sequences`` —
            one causal ``scaled_dot_product_attention`` per sequence (each sequence exactly as alone: the CPU path
            and the reference); ``auto`` — ``varlen`` where it runs, else ``sequences``.

    Returns:
        ``[1, heads, T, dv]`` in v's dtype.
    """
    if q.dim() != 4 or q.shape[0] != 1 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"packed_causal_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected q, k [1, heads, tokens, dk] and v [1, heads, tokens, dv]")
    cu = check_bounds(cu_seqlens, q.shape[2], "packed_causal_attention: cu_seqlens")
    if backend == "auto":
        backend = "varlen" if _varlen_usable(q, v) else "sequences"
    if backend == "varlen":
        if not q.is_cuda or _varlen_attn() is None:
            raise RuntimeError("packed_causal_attention: backend='varlen' needs CUDA and torch.nn.attention.varlen")
        return _varlen_attention(q, k, v, scale, cu, *_varlen_attn())
    if backend != "sequences":
        raise ValueError(f"packed_causal_attention: backend={backend!r}: expected auto, varlen or sequences")
    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
    return torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)


@functools.cache
def _varlen_attn():
    """``(varlen_attn, its keyword parameters)``, or None on a torch without a causal varlen API. torch 2.9 has
    ``is_causal`` and no ``scale``; 2.10 on ``window_size`` and ``scale``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = set(inspect.signature(varlen_attn).parameters)
    if not params & {"window_size", "is_causal"}:
        return None
    return varlen_attn, params


def _varlen_usable(q: torch.Tensor, v: torch.Tensor) -> bool:
    # FlashAttention: CUDA, half precision, head dims up to 256 in multiples of 8.
    dk = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and v.dtype == q.dtype and dk <= 256
            and dk % 8 == 0 and v.shape[-1] <= dk and _varlen_attn() is not None)


def _varlen_attention(q, k, v, scale, cu, varlen_attn, params) -> torch.Tensor:
    """``varlen_attn`` (torch's, with its keyword ``params``) on the ``[1, heads, T, d]`` tensors."""
    dk, dv = q.shape[-1], v.shape[-1]
    # FlashAttention takes one head dim: pad v with zero columns (their outputs are exactly zero).
    vp = F.pad(v, (0, dk - dv)) if dv < dk else v
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # (-1, 0): causal
    if "scale" in params:
        causal["scale"] = scale
    else:  # the kernel's own scale is dk^-1/2
        q = q * (scale * dk**0.5)
    bounds = cu.to(q.device, torch.int32, non_blocking=True)
    longest = int((cu[1:] - cu[:-1]).max())
    o = varlen_attn(q[0].transpose(0, 1), k[0].transpose(0, 1), vp[0].transpose(0, 1), bounds, bounds, longest,
                    longest, **causal)  # [T, heads, dk]
    return o[..., :dv].transpose(0, 1).unsqueeze(0)
