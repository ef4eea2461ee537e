"""The expert-LoRA kernels' plain-torch references, as fla keeps ``naive.py`` beside ``chunk.py``.

Each computes what its Triton kernel in ``triton.py`` (or ``schedule.py``) computes, with torch ops and per-expert
loops; the tests hold the kernels to them. None is on a training path: the torch path of the routed-expert
adapters is ``k3/lora/experts.py``'s plain math on ``grouped_mm``, and ``tile_schedule_reference`` (measured
slower than the schedule kernel: ~20 launches and 382 µs of host time vs one launch and 36 µs on the H200,
docs/PERFORMANCE.md) is ``tile_schedule``'s answer only where the kernels cannot run, i.e. for tests.
"""

from __future__ import annotations

import torch

from k3.kernels.grouped_mm import grouped_mm_reference, grouped_weight_grad_reference

__all__ = ["contract_reference", "expand_add_reference", "tile_schedule_reference", "weight_grad_reference"]


def expand_add_reference(out: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out + grouped(xa, B)`` in plain torch (a new tensor), for tests: ``out [rows, N]``, ``xa [rows, r]``,
    ``B [E, N, r]``, ``counts [E]``."""
    return out + grouped_mm_reference(xa, B, counts)


def contract_reference(h: torch.Tensor, A: torch.Tensor, counts: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · grouped(h, A)`` in plain torch, for tests: ``h [rows, K]``, ``A [E, r, K]`` -> ``[rows, r]``."""
    return grouped_mm_reference(h, A, counts) * scale


def weight_grad_reference(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The plain per-expert loop (``grouped_weight_grad_reference``), for tests: ``a [rows, P]``, ``b [rows, Q]``
    -> ``[E, P, Q]``."""
    return grouped_weight_grad_reference(a, b, counts)


def tile_schedule_reference(counts: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """``tile_schedule`` in torch ops (about 20 launches on CUDA): the plain reference of the schedule kernel.

    Args and return as ``k3.kernels.expert_lora.schedule.tile_schedule``: ``counts [E]`` integer, ``rows`` the
    host row count, ``block_m`` rows per tile -> ``[3, cdiv(rows, block_m) + E]`` int32 (expert, first row, end
    row per tile; expert -1 past the last real tile).
    """
    E = counts.shape[0]
    c = counts.to(torch.int64)
    ends = c.cumsum(0)
    starts = ends - c
    tiles = (c + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    tile_start = tile_end - tiles
    t = torch.arange(-(-rows // block_m) + E, device=counts.device)
    expert = torch.searchsorted(tile_end, t, right=True)  # the first expert whose tiles end after t
    e = expert.clamp(max=E - 1)
    row_start = starts[e] + (t - tile_start[e]) * block_m
    row_end = torch.minimum(ends[e], row_start + block_m)
    expert = torch.where(expert < E, expert, -1)
    return torch.stack([expert, row_start, row_end]).to(torch.int32)
