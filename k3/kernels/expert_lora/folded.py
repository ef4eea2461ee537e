"""Shared-outer expert LoRA folded into the base grouped GEMMs: the adapter rides along as extra K (or N) columns.

Measured slower; kept only as a comparison (see the end of this docstring).

The plain math (``k3/lora/experts.py``, the default and the reference) runs the base GEMM and the rank-r GEMMs
separately and then adds full-width outputs. Here, for expert ``e`` with ``s = alpha / r`` and ``xa = s · x Aᵀ``:

    gate_e = [xa1 0 | x] @ [B1_e 0 | w1_e]ᵀ       one grouped GEMM, K = slot + Lt
    up_e   = [x | xa3 0] @ [w3_e | B3_e 0]ᵀ       one grouped GEMM, K = Lt + slot
    [o | ha 0] = h @ [w2_e ; A2_e ; 0]ᵀ            one grouped GEMM, N = Lt + slot;   down_e = o + s · ha B2ᵀ

``slot`` >= r (``slot_width``: K/N may be rounded up to a tile multiple; the columns past r are zero). With
``shared_input`` both fc1 GEMMs read one buffer ``[xa1 0 | x | xa3 0]`` as column slices (one copy of x). The
augmented weights are the frozen base's own storage with the slot that each forward refreshes from the adapter
Parameter (``[E, F, r]``: a 22 MB copy at K3 widths). The backward is written out: one grouped GEMM per weight
for the input gradient (its extra K/N columns are the gradients of ``xa`` / ``ha``), and a row-grouped ``gᵀ x``
for each per-expert factor.

Measured on the H200 (docs/PERFORMANCE.md), this is slower than the plain path and than the Triton kernels
(``function.py``): forward+backward +19-21% over the frozen base vs +17-18% plain and +10% Triton, because torch's
grouped GEMM loses 8–12% of its speed at any K other than the base's, more than the passes over memory it saves. It
is no user choice (no flag selects it; ``--expert-lora-kernel`` picks between the plain path and the kernels): it
stays only as the comparison ``bench/gpu_expert_lora.py`` measures and the tests check, reachable as
``LoRALatentExperts(fused=True)``.

The adapter slot is read again in backward: the adapter must not change between a forward and its backward (an
optimizer step always comes after the backward). Dropout on the adapter input is not folded (the adapter would
see a different input than the base); the module takes the plain path then.
"""

from __future__ import annotations

import torch

from k3.kernels.grouped_mm import grouped_mm, grouped_weight_grad

__all__ = ["lora_gate_up", "lora_down", "slot_width", "SLOT_MULTIPLE", "SHARED_INPUT"]

# The layout LoRALatentExperts builds by default: augmented K/N = base + r rounded up to SLOT_MULTIPLE, gate/up
# inputs as slices of one buffer.
SLOT_MULTIPLE = 1
SHARED_INPUT = True


def slot_width(base: int, rank: int, multiple: int = 1) -> int:
    """Width of the adapter slot next to a base dimension of ``base``: at least ``rank``, and such that
    ``base + slot`` is a multiple of ``multiple`` (the columns past ``rank`` stay zero)."""
    if rank < 1 or multiple < 1:
        raise ValueError(f"slot_width: rank={rank}, multiple={multiple}: expected >= 1")
    return -(-(base + rank) // multiple) * multiple - base


class _GateUpLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, A, B1, B3, w1aug, w3aug, counts, scale, shared_input):
        r, Lt = B1.shape[-1], x.shape[1]
        s1, s3 = w1aug.shape[2] - Lt, w3aug.shape[2] - Lt  # slot widths (>= r; zero columns past r)
        with torch.no_grad():
            w1aug[:, :, :r].copy_(B1)
            w3aug[:, :, Lt:Lt + r].copy_(B3)
        xa = x @ A.T  # [rows, 2r]
        xa.mul_(scale)
        pad1, pad3 = x.new_zeros(x.shape[0], s1 - r), x.new_zeros(x.shape[0], s3 - r)
        if shared_input:  # one buffer [xa1 0 | x | xa3 0]: gate reads its first s1 + Lt columns, up its last Lt + s3
            xcat = torch.cat([xa[:, :r], pad1, x, xa[:, r:], pad3], dim=1)
            x1, x3 = xcat[:, :s1 + Lt], xcat[:, s1:]
        else:
            x1 = torch.cat([xa[:, :r], pad1, x], dim=1)
            x3 = torch.cat([x, xa[:, r:], pad3], dim=1)
        gate = grouped_mm(x1, w1aug, counts)
        up = grouped_mm(x3, w3aug, counts)
        # The augmented weights go on ctx, not save_for_backward: the next forward's slot refresh bumps their
        # version counter, and a second micro-batch's forward before this backward is legitimate.
        ctx.save_for_backward(x1, x3, A, counts)
        ctx.w1aug, ctx.w3aug, ctx.scale, ctx.r = w1aug, w3aug, scale, r
        return gate, up

    @staticmethod
    def backward(ctx, dgate, dup):
        x1, x3, A, counts = ctx.saved_tensors
        r, s = ctx.r, ctx.scale
        Lt = A.shape[1]
        s1 = x1.shape[1] - Lt
        dgate, dup = dgate.contiguous(), dup.contiguous()
        g1 = grouped_mm(dgate, ctx.w1aug.transpose(1, 2), counts)  # [rows, s1 + Lt] = [d xa1 0 | dx from gate]
        g3 = grouped_mm(dup, ctx.w3aug.transpose(1, 2), counts)  # [rows, Lt + s3] = [dx from up | d xa3 0]
        dxa = torch.cat([g1[:, :r], g3[:, Lt:Lt + r]], dim=1).mul_(s)  # d(x Aᵀ), [rows, 2r]
        dx = g1[:, s1:] + g3[:, :Lt]
        dx.addmm_(dxa, A)
        dA = dxa.T @ x3[:, :Lt]
        dB1 = grouped_weight_grad(dgate, x1[:, :r], counts)
        dB3 = grouped_weight_grad(dup, x3[:, Lt:Lt + r], counts)
        return dx, dA, dB1, dB3, None, None, None, None, None


class _DownLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, A2, B2, w2aug, counts, scale):
        r, Lt = A2.shape[1], B2.shape[0]
        with torch.no_grad():
            w2aug[:, Lt:Lt + r, :].copy_(A2)
        ocat = grouped_mm(h, w2aug, counts)  # [rows, Lt + slot] = [h w2ᵀ | h A2ᵀ 0]
        ha = ocat[:, Lt:Lt + r].contiguous()
        out = torch.addmm(ocat[:, :Lt], ha, B2.T, alpha=scale)
        ctx.save_for_backward(h, ha, B2, counts)
        ctx.w2aug, ctx.scale = w2aug, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        h, ha, B2, counts = ctx.saved_tensors
        s, w2aug = ctx.scale, ctx.w2aug
        Lt, r = B2.shape
        dout = dout.contiguous()
        dha = (dout @ B2).mul_(s)  # [rows, r]
        dB2 = (dout.T @ ha).mul_(s)  # [Lt, r]
        pad = dout.new_zeros(dout.shape[0], w2aug.shape[1] - Lt - r)
        dcat = torch.cat([dout, dha, pad], dim=1)  # [rows, Lt + slot]
        dh = grouped_mm(dcat, w2aug.transpose(1, 2), counts)
        dA2 = grouped_weight_grad(dha, h, counts)  # [E, r, F]
        return dh, dA2, dB2, None, None, None


def lora_gate_up(x: torch.Tensor, A: torch.Tensor, B1: torch.Tensor, B3: torch.Tensor, w1aug: torch.Tensor,
                 w3aug: torch.Tensor, counts: torch.Tensor, scale: float,
                 shared_input: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up projections of expert-sorted rows with the shared-A adapters folded in.

    Args:
        x: ``[rows, Lt]`` sorted by expert. A: ``[2r, Lt]`` = ``[w1_lora_A; w3_lora_A]``.
        B1, B3: ``[E, F, r]`` (w1/w3_lora_B). w1aug: ``[E, F, slot + Lt]`` = ``[B1 0 | w1]``; w3aug
            ``[E, F, Lt + slot]`` = ``[w3 | B3 0]`` (slot >= r; the first r slot columns are overwritten here and the
            rest must be zero).
        counts: ``[E]`` rows per expert. scale: ``alpha / r``.
        shared_input: gate's and up's inputs are column slices of one ``[xa1 0 | x | xa3 0]`` buffer (one copy
            of x); else two contiguous buffers (two copies).

    Returns:
        ``(gate, up)``, each ``[rows, F]``.
    """
    return _GateUpLoRA.apply(x, A, B1, B3, w1aug, w3aug, counts, float(scale), bool(shared_input))


def lora_down(h: torch.Tensor, A2: torch.Tensor, B2: torch.Tensor, w2aug: torch.Tensor, counts: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Down projection of expert-sorted rows with the per-expert-A, shared-B adapter folded in.

    Args:
        h: ``[rows, F]`` sorted by expert. A2: ``[E, r, F]`` (w2_lora_A). B2: ``[Lt, r]`` (w2_lora_B, shared).
        w2aug: ``[E, Lt + slot, F]`` = ``[w2 ; A2 ; 0]`` (its first r slot rows are overwritten with A2 here).
        counts: ``[E]``. scale: ``alpha / r``.

    Returns:
        ``[rows, Lt]``.
    """
    return _DownLoRA.apply(h, A2, B2, w2aug, counts, float(scale))
