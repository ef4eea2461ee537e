"""The routed experts' shared-outer LoRA on the Triton kernels, as the model and the Megatron backend call it.

- the choice: ``KERNEL_CHOICES`` (``auto|torch|triton``, the user's ``--expert-lora-kernel``), checked by
  ``check_kernel_choice``; ``kernels_run`` says whether an adapter set to one runs on the kernels now;
- the autograd functions: ``lora_gate_up`` / ``lora_down`` (``LoRALatentExperts(lora_impl="triton")``) and
  ``lora_fc1`` (Megatron's stacked fc1 weight): the plain path's math with the rank-r grouped GEMMs on
  ``triton.py``'s kernels, backward written out, each running its frozen base grouped GEMM (torch's) so the adapter
  is added into the base's output (forward) and into the base's input gradient (backward) in place;
- ``RowTiles``: one layer's row-tile schedules (``schedule.py``), shared by its gate/up and down, forward and
  backward.
"""

from __future__ import annotations

import torch

from k3.kernels import availability
from k3.kernels.expert_lora.schedule import row_tiles
from k3.kernels.expert_lora.triton import (DEFAULT_BLOCKS, check_counts, check_dtypes, contract, expand_add_,
                                           require_triton, weight_grad)
from k3.kernels.grouped_mm import grouped_mm

__all__ = ["KERNEL_CHOICES", "RowTiles", "check_kernel_choice", "kernels_run", "lora_down", "lora_fc1",
           "lora_gate_up"]

# How an expert adapter runs its rank-r grouped GEMMs: ``auto`` = ``triton`` where the kernels run (CUDA with
# Triton) and no dropout mask is active, else ``torch``; ``triton`` insists (an error where it cannot run).
KERNEL_CHOICES = ("auto", "torch", "triton")


def check_kernel_choice(kernel: str, flag: str = "lora_impl") -> None:
    """A ValueError naming ``flag`` unless ``kernel`` is one of ``KERNEL_CHOICES`` and, for ``triton``, Triton
    imports here (whether it can run on a given device is ``kernels_run``'s question)."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"{flag}={kernel!r}: expected one of {KERNEL_CHOICES}")
    if kernel == "triton" and not availability.triton_available():
        raise ValueError(f"{flag}='triton' needs Triton, which is not importable here; use {flag}='torch'")


def kernels_run(kernel: str, device: torch.device | str, dropout_active: bool, flag: str = "lora_impl") -> bool:
    """Whether an expert adapter set to ``kernel`` runs its rank-r parts on these kernels now.

    False for ``torch``, and while dropout is active (the torch path applies the mask); True for ``triton`` where
    the kernels run on ``device``; a ValueError naming ``flag`` where ``triton`` was asked for and they cannot;
    ``auto``: whether they run on ``device`` (never an error).
    """
    if kernel == "torch" or dropout_active:
        return False
    check_kernel_choice(kernel, flag)
    if kernel == "auto":
        return availability.triton_runs_on(device)
    if not availability.triton_runs_on(device):
        raise ValueError(f"{flag}='triton': the Triton kernels cannot run on {torch.device(device)} here (they need "
                         f"a CUDA device, or the CPU under TRITON_INTERPRET=1); use {flag}='torch'")
    return True


# ------------------------------------------------------------------------------------------------ autograd
# The routed experts' gate/up and down with shared-outer LoRA (k3/lora/experts.py's plain-path math), the rank-r
# grouped parts on the kernels of triton.py. Each Function runs its base grouped GEMM too (torch's, frozen weights: no
# gradient for them): the forward adds the adapter into the base output in place, and the backward adds the
# adapter's input gradient into the base's in place, one pass each instead of a product written and then added.
# The in-place adds touch only tensors created inside the Function, so no ``ctx.mark_dirty`` is involved and
# autograd's view of every input is unchanged.
class RowTiles:
    """The row tiles of one ``counts`` tensor for every kernel's ``block_m`` (built on first use, one Triton launch
    each) and the row offsets ``weight_grad`` takes (from the same launch). One serves the forward and backward of
    a layer's gate/up and down: ``LoRALatentExperts`` passes one to ``lora_gate_up`` and ``lora_down``.

    Args:
        counts: ``[E]`` integer rows per expert, on the rows' device.
        rows: the number of expert-sorted rows (a host int).
    """

    def __init__(self, counts: torch.Tensor, rows: int) -> None:
        self.counts, self.rows, self._by_block = counts, rows, {}

    def _build(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        if block_m not in self._by_block:
            self._by_block[block_m] = row_tiles(self.counts, self.rows, block_m)
        return self._by_block[block_m]

    def get(self, kernel: str) -> torch.Tensor:
        """The schedule for ``kernel``'s current ``DEFAULT_BLOCKS`` tile."""
        return self._build(DEFAULT_BLOCKS[kernel]["block_m"])[0]

    @property
    def offsets(self) -> torch.Tensor:
        """``[E + 1]`` int32 ``[0, cumsum(counts)]``."""
        return self._build(next(iter(self._by_block), DEFAULT_BLOCKS["expand"]["block_m"]))[1]

    def check(self, name: str, counts: torch.Tensor, rows: int) -> None:
        if rows != self.rows or counts.shape != self.counts.shape or counts.device != self.counts.device:
            raise ValueError(f"{name}: tiles built for {self.rows} rows and counts {tuple(self.counts.shape)} on "
                             f"{self.counts.device}, given {rows} rows and counts {tuple(counts.shape)} on "
                             f"{counts.device}: build RowTiles(counts, rows) for these rows")


class _GateUpLoRA(torch.autograd.Function):
    """Gate and up with shared-A LoRA. ``w3`` None: ``w1`` is megatron's fc1 weight ``[E, 2F, Lt]`` (gate rows,
    then up rows) and the output one ``[rows, 2F]`` tensor whose halves the kernels update as column views; else
    ``w1``/``w3`` are ``[E, F, Lt]`` each and the output ``(gate, up)``. Gate and up run as pairs: one launch each
    for their two adds, their two input-gradient products and their two factor gradients."""

    @staticmethod
    def forward(ctx, x, A, B1, B3, w1, w3, counts, scale, tiles):
        r, F_ = B1.shape[2], B1.shape[1]
        # The base GEMMs first: the device starts on them while the host launches the adapter's small kernels.
        if w3 is None:
            out = grouped_mm(x, w1, counts)  # [rows, 2F]: one base GEMM for both halves
            gate, up = out[:, :F_], out[:, F_:]
        else:
            gate, up = grouped_mm(x, w1, counts), grouped_mm(x, w3, counts)
        xa = (x @ A.T).mul_(scale)  # [rows, 2r]: the scale on the narrow product
        expand_add_((gate, up), (xa[:, :r], xa[:, r:]), (B1, B3), counts, schedule=tiles.get("expand"))
        ctx.save_for_backward(x, xa, A, B1, B3, w1, w3, counts)
        ctx.scale, ctx.tiles = scale, tiles
        return out if w3 is None else (gate, up)

    @staticmethod
    def backward(ctx, *grads):
        x, xa, A, B1, B3, w1, w3, counts = ctx.saved_tensors
        need_x, need_A, need_B1, need_B3 = ctx.needs_input_grad[:4]
        r, F_, s, tiles = B1.shape[2], B1.shape[1], ctx.scale, ctx.tiles
        # contiguous: torch's grouped GEMM rejects stride-0 gradients (an expanded ones_like, say)
        if w3 is None:
            dout = grads[0].contiguous()
            dgate, dup = dout[:, :F_], dout[:, F_:]
        else:
            dgate, dup = grads[0].contiguous(), grads[1].contiguous()
        dx = dA = dB1 = dB3 = None
        if need_x or need_A:
            dxa = xa.new_empty(xa.shape)  # d(x Aᵀ) = s · [dgate B1_e | dup B3_e], [rows, 2r]
            contract((dgate, dup), (B1.transpose(1, 2), B3.transpose(1, 2)), counts, s,
                     out=(dxa[:, :r], dxa[:, r:]), schedule=tiles.get("contract"))
            if need_x:
                if w3 is None:
                    dx = grouped_mm(dout, w1.transpose(1, 2), counts)
                else:
                    dx = grouped_mm(dgate, w1.transpose(1, 2), counts)
                    dx += grouped_mm(dup, w3.transpose(1, 2), counts)
                # dx += dxa A, the shared A as every expert's factor (stride 0): the kernel's one read-add-write
                expand_add_(dx, dxa, A.T.unsqueeze(0).expand(B1.shape[0], -1, -1), counts,
                            schedule=tiles.get("expand"))
            if need_A:
                dA = dxa.T @ x
        if need_B1 and need_B3:
            dB1, dB3 = weight_grad((dgate, dup), (xa[:, :r], xa[:, r:]), counts, offsets=tiles.offsets)
        elif need_B1:
            dB1 = weight_grad(dgate, xa[:, :r], counts, offsets=tiles.offsets)
        elif need_B3:
            dB3 = weight_grad(dup, xa[:, r:], counts, offsets=tiles.offsets)
        return dx, dA, dB1, dB3, None, None, None, None, None


class _DownLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, A2, B2, w2, counts, scale, tiles):
        out = grouped_mm(h, w2, counts)  # [rows, Lt]
        ha = contract(h, A2, counts, scale, schedule=tiles.get("contract"))  # [rows, r], scaled
        # out += ha B2ᵀ, the shared B as every expert's factor (stride 0): added in the kernel's epilogue
        expand_add_(out, ha, B2.unsqueeze(0).expand(A2.shape[0], -1, -1), counts, schedule=tiles.get("expand"))
        ctx.save_for_backward(h, ha, A2, B2, w2, counts)
        ctx.scale, ctx.tiles = scale, tiles
        return out

    @staticmethod
    def backward(ctx, dout):
        h, ha, A2, B2, w2, counts = ctx.saved_tensors
        need_h, need_A2, need_B2 = ctx.needs_input_grad[:3]
        s = ctx.scale
        dout = dout.contiguous()
        dh = dA2 = dB2 = None
        dha = (dout @ B2).mul_(s) if need_h or need_A2 else None  # [rows, r]
        if need_h:
            dh = grouped_mm(dout, w2.transpose(1, 2), counts)
            expand_add_(dh, dha, A2.transpose(1, 2), counts, schedule=ctx.tiles.get("expand"))
        if need_A2:
            dA2 = weight_grad(dha, h, counts, offsets=ctx.tiles.offsets)  # [E, r, F]
        if need_B2:
            dB2 = dout.T @ ha  # [Lt, r]; ha carries the scale
        return dh, dA2, dB2, None, None, None, None


def _tiles_for(name: str, tiles: RowTiles | None, counts: torch.Tensor, rows: int) -> RowTiles:
    if tiles is None:
        return RowTiles(counts, rows)
    tiles.check(name, counts, rows)
    return tiles


def _check_module_inputs(name: str, rows: torch.Tensor, counts: torch.Tensor, **tensors: torch.Tensor) -> None:
    check_dtypes(name, **tensors)
    require_triton(name, rows, *tensors.values())
    check_counts(name, counts, counts.shape[0] if counts.dim() == 1 else -1, rows.shape[0])


def lora_gate_up(x: torch.Tensor, A: torch.Tensor, B1: torch.Tensor, B3: torch.Tensor, w1: torch.Tensor,
                 w3: torch.Tensor, counts: torch.Tensor, scale: float,
                 tiles: RowTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up projections of expert-sorted rows with shared-A LoRA, the rank-r parts on the Triton kernels.

    ``gate = grouped(x, w1) + grouped(s · x A1ᵀ, B1)`` (up likewise with w3, A3, B3), as
    ``LoRALatentExperts.gate_up``'s plain path; gradients for x, A, B1 and B3, none for the frozen w1/w3.

    Args:
        x: ``[rows, Lt]`` sorted by expert. A: ``[2r, Lt]`` = ``[w1_lora_A; w3_lora_A]``.
        B1, B3: ``[E, F, r]``. w1, w3: ``[E, F, Lt]`` (frozen). counts: ``[E]`` rows per expert (moved to x's
            device). scale: ``alpha / r``. tiles: ``RowTiles(counts, rows)`` shared with the layer's
            ``lora_down`` (None: built here).

    Returns:
        ``(gate, up)``, each ``[rows, F]`` in x's dtype.
    """
    counts = counts.to(x.device)
    if A.dim() != 2 or B1.dim() != 3 or B1.shape != B3.shape or A.shape != (2 * B1.shape[2], x.shape[1]):
        raise ValueError(f"lora_gate_up: A {tuple(A.shape)}, B1 {tuple(B1.shape)}, B3 {tuple(B3.shape)} for x "
                         f"{tuple(x.shape)}: expected A [2r, Lt], B1 and B3 [E, F, r]")
    tiles = _tiles_for("lora_gate_up", tiles, counts, x.shape[0])
    _check_module_inputs("lora_gate_up", x, counts, x=x, A=A, B1=B1, B3=B3, w1=w1, w3=w3)
    return _GateUpLoRA.apply(x, A, B1, B3, w1, w3, counts, float(scale), tiles)


def lora_fc1(x: torch.Tensor, A: torch.Tensor, B1: torch.Tensor, B3: torch.Tensor, w13: torch.Tensor,
             counts: torch.Tensor, scale: float, tiles: RowTiles | None = None) -> torch.Tensor:
    """``lora_gate_up`` on megatron's fc1 layout: one stacked base weight, one ``[rows, 2F]`` output.

    ``out = [gate | up]`` with ``gate``/``up`` as in ``lora_gate_up`` and ``w1``/``w3`` the two halves of
    ``w13``; the base is one grouped GEMM (and one in the backward), the adapters are added into the output's
    halves in place.

    Args:
        x: ``[rows, Lt]`` sorted by expert. A: ``[2r, Lt]`` = ``[w1_lora_A; w3_lora_A]``.
        B1, B3: ``[E, F, r]``. w13: ``[E, 2F, Lt]`` (frozen; gate rows first). counts: ``[E]`` (moved to x's
            device). scale: ``alpha / r``. tiles: as ``lora_gate_up``'s.

    Returns:
        ``[rows, 2F]`` in x's dtype.
    """
    counts = counts.to(x.device)
    if A.dim() != 2 or B1.dim() != 3 or B1.shape != B3.shape or A.shape != (2 * B1.shape[2], x.shape[1]) \
            or w13.dim() != 3 or tuple(w13.shape) != (B1.shape[0], 2 * B1.shape[1], x.shape[1]):
        raise ValueError(f"lora_fc1: A {tuple(A.shape)}, B1 {tuple(B1.shape)}, B3 {tuple(B3.shape)}, w13 "
                         f"{tuple(w13.shape)} for x {tuple(x.shape)}: expected A [2r, Lt], B1 and B3 [E, F, r], "
                         "w13 [E, 2F, Lt]")
    tiles = _tiles_for("lora_fc1", tiles, counts, x.shape[0])
    _check_module_inputs("lora_fc1", x, counts, x=x, A=A, B1=B1, B3=B3, w13=w13)
    return _GateUpLoRA.apply(x, A, B1, B3, w13, None, counts, float(scale), tiles)


def lora_down(h: torch.Tensor, A2: torch.Tensor, B2: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
              scale: float, tiles: RowTiles | None = None) -> torch.Tensor:
    """Down projection of expert-sorted rows with per-expert-A, shared-B LoRA, the rank-r parts on the kernels.

    ``out = grouped(h, w2) + s · grouped(h, A2) B2ᵀ``, as ``LoRALatentExperts.down``'s plain path; gradients for
    h, A2 and B2, none for the frozen w2.

    Args:
        h: ``[rows, F]`` sorted by expert. A2: ``[E, r, F]``. B2: ``[Lt, r]`` (shared). w2: ``[E, Lt, F]``
            (frozen). counts: ``[E]`` (moved to h's device). scale: ``alpha / r``. tiles: ``RowTiles(counts,
            rows)`` shared with the layer's ``lora_gate_up`` (None: built here).

    Returns:
        ``[rows, Lt]`` in h's dtype.
    """
    counts = counts.to(h.device)
    if A2.dim() != 3 or B2.dim() != 2 or A2.shape[2] != h.shape[1] or B2.shape[1] != A2.shape[1]:
        raise ValueError(f"lora_down: A2 {tuple(A2.shape)}, B2 {tuple(B2.shape)} for h {tuple(h.shape)}: expected "
                         "A2 [E, r, F], B2 [Lt, r]")
    tiles = _tiles_for("lora_down", tiles, counts, h.shape[0])
    _check_module_inputs("lora_down", h, counts, h=h, A2=A2, B2=B2, w2=w2)
    return _DownLoRA.apply(h, A2, B2, w2, counts, float(scale), tiles)
