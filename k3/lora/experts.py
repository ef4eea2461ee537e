"""Shared-outer LoRA on the routed experts: the outer factors are shared by all experts, the inner ones are not.

For expert e, with ``s = alpha / r``, ``Lt`` the latent width and ``F`` the expert width:

    gate_e(x) = w1_e x + s · w1_lora_B[e] (w1_lora_A x)      w1_lora_A [r, Lt] shared,  w1_lora_B [E, F, r]
    up_e(x)   = w3_e x + s · w3_lora_B[e] (w3_lora_A x)      w3_lora_A [r, Lt] shared,  w3_lora_B [E, F, r]
    down_e(h) = w2_e h + s · w2_lora_B (w2_lora_A[e] h)      w2_lora_A [E, r, F],       w2_lora_B [Lt, r] shared

"Shared-outer" (the recipe's ``--experts-shared-outer-loras``, SGLang's serving layout): gate/up share A on
the input side, down shares B on the output side. The hot path is batched over experts: one ordinary GEMM of
all rows with the stacked shared ``[w1_lora_A; w3_lora_A]``, then grouped per-expert GEMMs with the B's
(and for down, a grouped GEMM with the per-expert A's, then one GEMM with the shared B) — no Python loop
over experts.

That plain path is the default and the reference. The fused path (``fused=True``; ``k3/kernels/expert_lora/folded.py``)
folds the adapters into the base grouped GEMMs as r extra K/N columns — on the H200 it measured slower than the
plain path (19.5–23% vs 17.8% of the base forward+backward, docs/PERFORMANCE.md: the native grouped GEMM loses
~8% efficiency at K = base + r), so it is opt-in. With it, the frozen ``w1``/``w3``/``w2`` then live in
"augmented" storage with an adapter slot (``w1`` is a view ``[E, F, Lt]`` of ``[E, F, slot + Lt]``; +slot/Lt
memory, 0.9% at K3 widths). The storage is rebuilt when something replaces a base weight's tensor (``.to()``,
``load_state_dict(assign=True)``); in-place writes (loading, merging) keep it.

``lora_impl="triton"`` runs the plain path's rank-r grouped GEMMs on Triton kernels (``k3/kernels/expert_lora/``:
the full-width adds in the kernels' epilogues, torch's grouped GEMM measured far from bandwidth at rank r). Same
math; on the H200 +8.2-9.2% over the frozen experts' forward+backward (back to back) vs +15-17% for torch.
``lora_impl="auto"`` takes it where it runs; ``k3 train --expert-lora-kernel`` defaults to auto.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.expert_lora import function as expert_lora
from k3.kernels.expert_lora.folded import SHARED_INPUT, SLOT_MULTIPLE, lora_down, lora_gate_up, slot_width
from k3.kernels.grouped_mm import grouped_mm
from k3.lora.linear import xavier_bound
from k3.model.mlp import situ
from k3.model.moe import LatentExperts

__all__ = ["LoRALatentExperts", "EXPERT_FACTORS"]

# Factor names in the order a routed-experts chunk lists them.
EXPERT_FACTORS = ("w1_lora_A", "w1_lora_B", "w3_lora_A", "w3_lora_B", "w2_lora_A", "w2_lora_B")

# Augmented storage per base weight: (dim that grows by the slot, whether the base sits after the slot).
# w1aug = [B1 | w1] and w3aug = [w3 | B3] so that gate's and up's inputs are column slices of one
# [xa1 | x | xa3] buffer; w2aug = [w2 ; A2].
_AUGMENTED = {"w1": (2, True), "w3": (2, False), "w2": (1, False)}

LORA_IMPLS = expert_lora.KERNEL_CHOICES  # how the plain path runs its rank-r grouped GEMMs


class LoRALatentExperts(LatentExperts):
    """``LatentExperts`` with shared-outer adapters on gate/up (``fc1``) and/or down (``fc2``).

    Built from an existing ``LatentExperts``: its stacked ``w1``/``w3``/``w2`` Parameters are adopted (not
    copied) and frozen, and its HF per-expert ``state_dict`` names are kept; the adapter factors are saved
    under ``w1_lora_A`` etc. A's are Xavier-uniform per expert slice, B's zero.

    Args:
        base: the experts to adapt.
        rank, alpha, dropout: as ``LoRAConfig`` (dropout on the adapter input, training only).
        fc1: adapt gate and up (``mlp.experts.linear_fc1``). fc2: adapt down (``mlp.experts.linear_fc2``).
        fused: fold the adapters into the base GEMMs (``k3/kernels/expert_lora/folded.py``; measured slower on the H200,
            hence off by default); ``False`` keeps the base weights as they are and runs the plain path. Active
            dropout always takes the plain path.
        lora_impl: how the plain path runs its rank-r grouped GEMMs: ``"torch"`` (the default and the reference:
            torch's grouped GEMM, then full-width adds), ``"triton"`` (``k3/kernels/expert_lora/``: Triton
            kernels with the adds in their epilogues; same math, gradients for the input rows and every factor;
            H200, K3's EP8 shapes: +8.2-9.2% over the frozen experts' forward+backward vs +15-17% for torch,
            docs/PERFORMANCE.md) or ``"auto"`` (triton where it runs, else torch). "triton" needs Triton and a CUDA
            device (or the CPU under ``TRITON_INTERPRET=1``), else a ValueError names ``"torch"``; it cannot be
            combined with ``fused`` (``auto`` defers to ``fused``); active dropout takes the torch path.
    """

    def __init__(self, base: LatentExperts, rank: int, alpha: float, dropout: float = 0.0,
                 fc1: bool = True, fc2: bool = True, fused: bool = False, lora_impl: str = "torch") -> None:
        nn.Module.__init__(self)
        if not isinstance(base, LatentExperts):
            raise TypeError(f"LoRALatentExperts wraps LatentExperts, got {type(base).__name__}")
        if isinstance(base, LoRALatentExperts):
            raise TypeError("these experts already carry LoRA adapters (apply_lora was called twice?)")
        if not (fc1 or fc2):
            raise ValueError("LoRALatentExperts needs fc1 and/or fc2")
        _check_lora_impl(lora_impl, fused)
        # Adopt the base module's whole state (parameters, attributes, hooks); the dicts are copied so the
        # adapters registered below do not appear on ``base``.
        for key, value in base.__dict__.items():
            self.__dict__[key] = value.copy() if isinstance(value, dict) else value
        for p in (self.w1, self.w2, self.w3):
            p.requires_grad_(False)
        E, Fi, Lt = self.w1.shape
        self.rank, self.alpha, self.scale, self.dropout = rank, float(alpha), float(alpha) / rank, float(dropout)
        self.fc1, self.fc2 = fc1, fc2
        self.merged = False
        like = self.w1

        def factor(*shape: int, fan_in: int | None = None) -> nn.Parameter:
            t = torch.zeros(*shape, device=like.device, dtype=like.dtype)
            if fan_in is not None:  # an A factor: Xavier-uniform over its [r, fan_in] (per-expert) slice
                bound = xavier_bound(rank, fan_in)
                nn.init.uniform_(t, -bound, bound)
            return nn.Parameter(t)

        if fc1:
            self.w1_lora_A = factor(rank, Lt, fan_in=Lt)
            self.w3_lora_A = factor(rank, Lt, fan_in=Lt)
            self.w1_lora_B = factor(E, Fi, rank)
            self.w3_lora_B = factor(E, Fi, rank)
        if fc2:
            self.w2_lora_A = factor(E, rank, Fi, fan_in=Fi)
            self.w2_lora_B = factor(Lt, rank)
        self.fused, self.lora_impl = fused, lora_impl
        # The fused path's layout (k3/kernels/expert_lora/folded.py): augmented K/N rounded up to this multiple, and
        # gate/up reading slices of one input buffer. Changing either rebuilds the storage at the next forward.
        self.slot_multiple, self.shared_input = SLOT_MULTIPLE, SHARED_INPUT
        self._augmented_storage: dict[str, torch.Tensor] = {}
        if fused:
            for name in self._augmented_names():
                self._augmented(name)

    # ------------------------------------------------------------------ augmented storage (fused path)
    def _augmented_names(self) -> tuple[str, ...]:
        return (("w1", "w3") if self.fc1 else ()) + (("w2",) if self.fc2 else ())

    def _augmented(self, name: str) -> torch.Tensor:
        """The ``[w | slot]`` storage that base weight ``name`` is a view of; (re)built if ``name`` is not."""
        w = getattr(self, name)
        dim, after = _AUGMENTED[name]
        slot = slot_width(w.shape[dim], self.rank, self.slot_multiple)
        aug = self._augmented_storage.get(name)
        if (aug is not None and aug.device == w.device and aug.dtype == w.dtype
                and aug.shape[dim] == w.shape[dim] + slot):
            view = aug.narrow(dim, slot if after else 0, w.shape[dim])
            if view.data_ptr() == w.data_ptr() and view.stride() == w.stride() and view.shape == w.shape:
                return aug
        shape = list(w.shape)
        shape[dim] += slot
        aug = w.new_zeros(shape)  # the slot's columns past r stay zero
        view = aug.narrow(dim, slot if after else 0, w.shape[dim])
        with torch.no_grad():
            view.copy_(w)
        w.data = view  # the Parameter keeps its identity (optimizers, hooks) and now aliases the storage
        self._augmented_storage[name] = aug
        return aug

    def _use_fused(self) -> bool:
        return self.fused and not self.merged and not (self.dropout > 0 and self.training)

    def _use_triton(self, rows: torch.Tensor) -> bool:
        """Whether the plain path runs on the Triton kernels; a ValueError where they were asked for but cannot run."""
        if self.lora_impl != "torch":
            _check_lora_impl(self.lora_impl, self.fused)
        if self.lora_impl == "auto" and self.fused:  # fused was asked for explicitly: auto defers to it
            return False
        return expert_lora.kernels_run(self.lora_impl, rows.device, self.dropout > 0 and self.training)

    def factor_names(self) -> tuple[str, ...]:
        """The adapter factors this module holds, in chunk order."""
        have = set()
        if self.fc1:
            have |= {"w1_lora_A", "w1_lora_B", "w3_lora_A", "w3_lora_B"}
        if self.fc2:
            have |= {"w2_lora_A", "w2_lora_B"}
        return tuple(n for n in EXPERT_FACTORS if n in have)

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [rows, Lt]`` sorted by expert (``counts[e]`` rows of expert e) -> ``[rows, Lt]``."""
        tiles = None
        if (self.fc1 or self.fc2) and not self.merged and self._use_triton(x):  # one row-tile schedule for both
            tiles = expert_lora.RowTiles(counts.to(x.device), x.shape[0])
        return self.down(situ(*self.gate_up(x, counts, tiles), self.beta, self.linear_beta), counts, tiles)

    def gate_up(self, x: torch.Tensor, counts: torch.Tensor,
                tiles: expert_lora.RowTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [rows, Lt]`` sorted by expert, ``counts [E]`` -> ``(gate [rows, F], up [rows, F])``; ``tiles``: the
        Triton path's row tiles, shared with ``down``."""
        if not self.fc1 or self.merged:
            return super().gate_up(x, counts)
        shared_A = torch.cat([self.w1_lora_A, self.w3_lora_A])  # [2r, Lt]: one GEMM for both projections
        if self._use_triton(x):  # first: it raises if fused was set too
            return expert_lora.lora_gate_up(x, shared_A, self.w1_lora_B, self.w3_lora_B, self.w1, self.w3, counts,
                                             self.scale, tiles)
        if self._use_fused():
            return lora_gate_up(x, shared_A, self.w1_lora_B, self.w3_lora_B, self._augmented("w1"),
                                self._augmented("w3"), counts, self.scale, self.shared_input)
        r = self.rank
        # The scale goes on the narrow [rows, 2r] product, not the wide [rows, F] outputs: one fewer full pass.
        gate, up = super().gate_up(x, counts)
        xa = (self._adapter_input(x) @ shared_A.T) * self.scale  # [rows, 2r]
        gate = gate + grouped_mm(xa[:, :r], self.w1_lora_B, counts)
        up = up + grouped_mm(xa[:, r:], self.w3_lora_B, counts)
        return gate, up

    def down(self, h: torch.Tensor, counts: torch.Tensor, tiles: expert_lora.RowTiles | None = None) -> torch.Tensor:
        """``h [rows, F]`` sorted by expert -> ``[rows, Lt]``; ``tiles`` as ``gate_up``'s."""
        if not self.fc2 or self.merged:
            return super().down(h, counts)
        if self._use_triton(h):
            return expert_lora.lora_down(h, self.w2_lora_A, self.w2_lora_B, self.w2, counts, self.scale, tiles)
        if self._use_fused():
            return lora_down(h, self.w2_lora_A, self.w2_lora_B, self._augmented("w2"), counts, self.scale)
        out = super().down(h, counts)
        ha = grouped_mm(self._adapter_input(h), self.w2_lora_A, counts)  # [rows, r]
        return torch.addmm(out, ha, self.w2_lora_B.T, alpha=self.scale)  # scale, GEMM and add in one kernel

    # ------------------------------------------------------------------ merge support
    def delta_weights(self) -> dict[str, torch.Tensor]:
        """The adapters as stacked weight deltas in float32: ``w1``/``w3`` [E, F, Lt], ``w2`` [E, Lt, F]."""
        out: dict[str, torch.Tensor] = {}
        if self.fc1:
            out["w1"] = self.scale * (self.w1_lora_B.float() @ self.w1_lora_A.float())
            out["w3"] = self.scale * (self.w3_lora_B.float() @ self.w3_lora_A.float())
        if self.fc2:
            out["w2"] = self.scale * (self.w2_lora_B.float() @ self.w2_lora_A.float())  # [Lt,r] @ [E,r,F]
        return out

    # ------------------------------------------------------------------ state dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)  # HF per-expert base names
        for name in self.factor_names():
            p = getattr(self, name)
            destination[prefix + name] = p if keep_vars else p.detach()

    def extra_repr(self) -> str:
        E, Fi, Lt = self.w1.shape
        return (f"experts={E}, latent={Lt}, intermediate={Fi}, rank={self.rank}, alpha={self.alpha:g}, "
                f"dropout={self.dropout:g}, fc1={self.fc1}, fc2={self.fc2}, fused={self.fused}, "
                f"lora_impl={self.lora_impl}, merged={self.merged}")


def _check_lora_impl(lora_impl: str, fused: bool) -> None:
    expert_lora.check_kernel_choice(lora_impl)
    if lora_impl == "triton" and fused:
        raise ValueError("lora_impl='triton' runs the plain path; it cannot be combined with fused=True "
                         "(use fused=False, or lora_impl='torch' with fused=True)")
