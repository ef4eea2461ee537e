"""Grouped GEMM for rows sorted by expert: ``out[r] = x[r] @ w[e(r)]ᵀ``, one call for all experts.

``torch.nn.functional.grouped_mm`` (torch 2.13) runs on CPU for float32 and bfloat16 and on CUDA for
bfloat16. Its contract, checked on this torch: the right operand is ``[E, in, out]`` (our ``[E, out, in]``
weight transposed, a view), ``offs`` is int32 with ``offs[e]`` = the end row of expert ``e`` (cumulative
counts), and every row stride must be a multiple of 16 bytes (``in`` and ``out`` × element size), or it
raises "strides should be multiple of 16 bytes" (forward for ``in``, backward for ``out``). Shapes it cannot
take go through a padded batched matmul instead. Neither path loops over experts in Python.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm", "grouped_mm_reference", "grouped_weight_grad", "grouped_weight_grad_reference",
           "native_grouped_mm_supported"]

Impl = Literal["auto", "native", "padded"]

# torch 2.13 has the public ``F.grouped_mm``; older builds (the device's torch 2.11) have only the private
# ``torch._grouped_mm`` with the same (mat_a, mat_b, offs) contract.
_NATIVE = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _native_dtype_ok(x: torch.Tensor) -> bool:
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its rows are unit-stride and 16-byte aligned (a column slice of a wider buffer
    qualifies), else a contiguous copy: the native kernel takes a leading dimension, so slices need no copy."""
    size = x.element_size()
    if (x.stride(-1) == 1 and (x.stride(-2) * size) % 16 == 0 and x.stride(-2) >= x.shape[-1]
            and x.data_ptr() % 16 == 0):
        return x
    return x.contiguous()


def native_grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes these operands (dtype, device and the 16-byte stride rule)."""
    if _NATIVE is None or x.dtype != w.dtype or x.device != w.device:
        return False
    size = x.element_size()
    # w may be a view (a slice of augmented storage, or a transpose): one of its two matrix strides must be 1
    # and the other a multiple of 16 bytes.
    strides_ok = ((w.stride(-1) == 1 and (w.stride(-2) * size) % 16 == 0)
                  or (w.stride(-2) == 1 and (w.stride(-1) * size) % 16 == 0))
    return (_native_dtype_ok(x) and strides_ok and (w.shape[2] * size) % 16 == 0
            and (w.shape[1] * size) % 16 == 0)


def _check(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}: expected x [N, in] and "
                         "w [E, out, in] with the same in")
    if counts.dim() != 1 or counts.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_mm: counts {tuple(counts.shape)}: expected [E] = [{w.shape[0]}]")
    if counts.dtype.is_floating_point:
        raise ValueError(f"grouped_mm: counts dtype {counts.dtype}: expected an integer tensor")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """Per-expert matmul of expert-sorted rows.

    Args:
        x: ``[N, in]``, rows sorted by expert (expert 0's rows first).
        w: ``[E, out, in]`` (``nn.Linear`` layout per expert).
        counts: ``[E]`` integer, rows per expert; must sum to N.
        impl: ``native`` (F.grouped_mm), ``padded`` (batched matmul over a padded ``[E, max_count, in]``),
            or ``auto`` (native when supported).

    Returns:
        ``[N, out]`` in x's dtype.
    """
    _check(x, w, counts)
    if not x.is_cuda:  # a device sync on CUDA; on CPU cheap, and a wrong count would silently drop rows
        total = int(counts.sum())
        if total != x.shape[0] or bool((counts < 0).any()):
            raise ValueError(f"grouped_mm: counts sum to {total} (min {int(counts.min())}): expected "
                             f"non-negative counts summing to the {x.shape[0]} rows of x")
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    if impl == "auto":
        impl = "native" if native_grouped_mm_supported(x, w) else "padded"
    if impl == "native":
        offs = counts.cumsum(0).to(torch.int32)
        out = _NATIVE(_row_major(x), w.transpose(-2, -1), offs=offs)
        if out.requires_grad:
            # Its backward rejects a stride-0 gradient (what ``out.sum().backward()`` sends), so densify it.
            out.register_hook(lambda grad: grad.contiguous())
        return out
    if impl == "padded":
        return _padded_bmm(x, w, counts)
    raise ValueError(f"grouped_mm: impl={impl!r}: expected auto, native or padded")


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    E = w.shape[0]
    counts = counts.to(device=x.device, dtype=torch.long)
    expert_of_row, slot = _row_slots(counts, x.shape[0])
    padded = x.new_zeros(E, int(counts.max()), x.shape[1])
    padded = padded.index_put((expert_of_row, slot), x)
    out = torch.bmm(padded, w.transpose(1, 2))  # [E, max_count, out]
    return out[expert_of_row, slot]


def _row_slots(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row: its expert and its position among that expert's rows (``counts`` long, on x's device)."""
    expert_of_row = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    starts = counts.cumsum(0) - counts
    return expert_of_row, torch.arange(rows, device=counts.device) - starts[expert_of_row]


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The plain per-expert loop, for tests."""
    _check(x, w, counts)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        outs.append(x[start:start + n] @ w[e].T)
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


def grouped_weight_grad(g: torch.Tensor, x: torch.Tensor, counts: torch.Tensor,
                        impl: Impl = "auto") -> torch.Tensor:
    """Per-expert ``gᵀ x`` of expert-sorted rows: the weight gradient of ``grouped_mm``.

    Args:
        g: ``[N, out]`` (the output gradient), rows sorted by expert.
        x: ``[N, in]`` (the layer input), same rows.
        counts: ``[E]`` rows per expert, summing to N.
        impl: as ``grouped_mm``; ``native`` is ``F.grouped_mm`` grouped along the reduction (row) dimension.

    Returns:
        ``[E, out, in]`` in x's dtype (float32 accumulation on the native path); zeros for an expert with no rows.
    """
    if g.dim() != 2 or x.dim() != 2 or g.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_weight_grad: g {tuple(g.shape)}, x {tuple(x.shape)}: expected [N, out] "
                         "and [N, in] with the same N")
    if counts.dim() != 1 or counts.dtype.is_floating_point:
        raise ValueError(f"grouped_weight_grad: counts {tuple(counts.shape)} {counts.dtype}: expected [E] integer")
    E = counts.shape[0]
    if not x.is_cuda and int(counts.sum()) != x.shape[0]:
        raise ValueError(f"grouped_weight_grad: counts sum to {int(counts.sum())}: expected the {x.shape[0]} rows")
    if impl == "auto":
        ok = (_NATIVE is not None and g.dtype == x.dtype and g.device == x.device and _native_dtype_ok(x)
              and (x.shape[1] * x.element_size()) % 16 == 0 and (g.shape[1] * g.element_size()) % 16 == 0)
        impl = "native" if ok and x.shape[0] > 0 else "padded"
    if impl == "native":
        offs = counts.cumsum(0).to(torch.int32)
        # [out, N] (a transposed view) times [N, in], grouped along N: one output matrix per expert.
        return _NATIVE(g.contiguous().t(), x.contiguous(), offs=offs)
    if impl == "padded":
        if x.shape[0] == 0:
            return x.new_zeros(E, g.shape[1], x.shape[1])
        expert_of_row, slot = _row_slots(counts.to(device=x.device, dtype=torch.long), x.shape[0])
        width = int(counts.max())
        gp = g.new_zeros(E, width, g.shape[1]).index_put((expert_of_row, slot), g)
        xp = x.new_zeros(E, width, x.shape[1]).index_put((expert_of_row, slot), x)
        return torch.bmm(gp.transpose(1, 2), xp)  # padding rows are zero, so they add nothing
    raise ValueError(f"grouped_weight_grad: impl={impl!r}: expected auto, native or padded")


def grouped_weight_grad_reference(g: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The plain per-expert loop, for tests."""
    outs, start = [], 0
    for n in counts.tolist():
        outs.append(g[start:start + n].T @ x[start:start + n])
        start += n
    return torch.stack(outs)
