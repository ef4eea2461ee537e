"""The row-tile schedule of expert-sorted rows: which ``BLOCK_M`` rows of which expert each program of the
expert-LoRA kernels (``triton.py``) takes.

Rows are sorted by expert (``counts[e]`` rows of expert ``e``, in order); a tile is ``block_m`` rows of one expert
(the last tile of an expert is partial). The tile -> (expert, row start, row end) schedule is built on the device
from ``counts`` in one small Triton launch (``row_tiles``: no host sync, 16 µs on the H200), which also writes the
row offsets ``weight_grad`` reads; ``tile_schedule_reference`` (``reference.py``) is the same in torch ops (~20
launches). Its length is an upper bound, ``cdiv(rows, block_m) + E``, so the kernels' grids need no host sync
either: the tiles past the last real one are marked with expert -1 and their programs exit at once. A layer
builds it once (``function.RowTiles``) for its gate/up and down, forward and backward.
"""

from __future__ import annotations

import torch

from k3.kernels import availability
from k3.kernels.expert_lora.reference import tile_schedule_reference

__all__ = ["MAX_EXPERTS", "checked_schedule", "row_offsets", "row_tiles", "tile_schedule"]

try:  # the kernel is module-level
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - ImportError, or a broken Triton install: tile_schedule_reference serves
    triton = None

MAX_EXPERTS = 4096  # the schedule kernel holds every expert's count in one block
_MIN_BLOCK_E = 16  # the experts' block, a power of two (tl.arange), at least the other kernels' smallest block

if triton is not None:

    @triton.jit
    def _schedule_kernel(counts_ptr, sched_ptr, offs_ptr, E, n_tiles,
                         BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
        # BLOCK_T tiles of the row-tile schedule per program (tile_schedule_reference's math; torch's ops for the
        # same are ~20 launches); program 0 also writes the row offsets. Every program redoes the E-long prefix
        # sums: cheaper than a second launch. int32 throughout (rows < 2^31); experts past E are padding with no
        # rows and no tiles. The [BLOCK_T, BLOCK_E] one-hot blocks stay small: wide ones spill registers.
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        c = tl.load(counts_ptr + e, mask=e_ok, other=0).to(tl.int32)
        ends = tl.cumsum(c, 0)
        starts = ends - c
        tiles = (c + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, 0)
        tile_start = tile_end - tiles
        if tl.program_id(0) == 0:
            tl.store(offs_ptr + e, starts, mask=e_ok)
            tl.store(offs_ptr + E, tl.sum(c, 0))
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        # the first expert whose tiles end after t: how many end at or before it
        expert = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), 1)
        pick = e[None, :] == tl.minimum(expert, E - 1)[:, None]  # one-hot gather of that expert's values
        row_start = tl.sum(tl.where(pick, starts[None, :] - tile_start[None, :] * BLOCK_M, 0), 1) + t * BLOCK_M
        row_end = tl.minimum(tl.sum(tl.where(pick, ends[None, :], 0), 1), row_start + BLOCK_M)
        t_ok = t < n_tiles
        tl.store(sched_ptr + t, tl.where(expert < E, expert, -1), mask=t_ok)
        tl.store(sched_ptr + n_tiles + t, row_start, mask=t_ok)
        tl.store(sched_ptr + 2 * n_tiles + t, row_end, mask=t_ok)


def tile_schedule(counts: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """The row tiles of expert-sorted rows, on ``counts``' device with no host sync.

    Args:
        counts: ``[E]`` integer rows per expert (summing to ``rows``).
        rows: the total number of rows (a host int: the row tensor's length).
        block_m: rows per tile.

    Returns:
        ``[3, T]`` int32, ``T = cdiv(rows, block_m) + E`` (an upper bound on ``Σ_e cdiv(counts[e], block_m)``):
        per tile its expert, first row and end row (exclusive); expert ``-1`` marks the tiles past the last
        real one. Experts without rows get no tile. One Triton launch where the kernels run on ``counts``' device
        (``row_tiles``), else ``tile_schedule_reference``.
    """
    if availability.triton_runs_on(counts.device):
        return row_tiles(counts, rows, block_m)[0]
    return tile_schedule_reference(counts, rows, block_m)


def _schedule_block_t(block_e: int) -> int:
    """Tiles per program of the schedule kernel: [BLOCK_T, BLOCK_E] one-hot blocks of at most 2048 entries."""
    return max(2, min(16, 2048 // block_e))


def row_tiles(counts: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile_schedule(counts, rows, block_m), row_offsets(counts))`` from one Triton launch.

    Needs the kernels to run on ``counts``' device; ``counts`` is ``[E]`` integer, ``E <= 4096`` (one block), with
    fewer than 2^31 rows.
    """
    E = counts.shape[0]
    if E > MAX_EXPERTS:
        raise ValueError(f"row_tiles: {E} experts: the schedule kernel holds them in one block (<= {MAX_EXPERTS})")
    n_tiles = -(-rows // block_m) + E
    sched = torch.empty(3, n_tiles, dtype=torch.int32, device=counts.device)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=counts.device)
    block_e = max(_MIN_BLOCK_E, triton.next_power_of_2(E))
    block_t = _schedule_block_t(block_e)
    _schedule_kernel[(triton.cdiv(n_tiles, block_t),)](counts, sched, offsets, E, n_tiles, BLOCK_M=block_m,
                                                      BLOCK_E=block_e, BLOCK_T=block_t)
    return sched, offsets


def checked_schedule(name: str, schedule: torch.Tensor | None, counts: torch.Tensor, rows: int,
                     block_m: int) -> torch.Tensor:
    """``schedule`` if given (a ValueError naming ``name`` unless it has the shape, dtype and device of
    ``tile_schedule(counts, rows, block_m)``), else a new one."""
    if schedule is None:
        return tile_schedule(counts, rows, block_m)
    want = (3, -(-rows // block_m) + counts.shape[0])
    if tuple(schedule.shape) != want or schedule.dtype != torch.int32 or schedule.device != counts.device:
        raise ValueError(f"{name}: schedule {tuple(schedule.shape)} {schedule.dtype} on {schedule.device}: expected "
                         f"tile_schedule(counts, {rows}, block_m={block_m}), {want} int32 on {counts.device}")
    return schedule


def row_offsets(counts: torch.Tensor) -> torch.Tensor:
    """``[E + 1]`` int32: ``[0, cumsum(counts)]`` (expert e's rows are ``offs[e]:offs[e + 1]``)."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
