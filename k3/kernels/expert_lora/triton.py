"""Rank-r grouped GEMMs for expert-sorted rows: the LoRA half of the routed experts, as Triton kernels.

Rows are sorted by expert (``counts[e]`` rows of expert ``e``, in order). With ``r`` the LoRA rank (small: 4-256)
and ``e(i)`` the expert of row ``i``, three kernels cover every rank-r product of ``k3/lora/experts.py``'s plain
path, forward and backward:

    expand_add_(out, xa, B)   out[i, :] += xa[i] @ B[e(i)]ᵀ          out [rows, N], xa [rows, r], B [E, N, r]
    contract(h, A)            ha[i]      = scale · h[i] @ A[e(i)]ᵀ    h [rows, K], A [E, r, K] -> [rows, r]
    weight_grad(a, b)         W[e]       = a_eᵀ b_e                   a [rows, P], b [rows, Q] -> [E, P, Q]

``expand_add_`` is the up-projection with the full-width add in its epilogue: the ``[rows, N]`` tile is read,
the rank-r product added in fp32 and the tile written back once (torch's path writes the product, then reads two
and writes one). Every operand is taken through its strides, so the transposes the backward needs are views:
``dxa = dgate @ B_e`` is ``contract(dgate, B.transpose(1, 2))`` and ``dh += dha @ A_e`` is
``expand_add_(dh, dha, A.transpose(1, 2))``.

Why kernels: torch's grouped GEMM runs these shapes far from bandwidth on the H200 (``[rows, 32] x [E, 32, 3072]``
at 11 TFLOP/s, 0.28 ms, for ~0.05 ms of memory traffic; docs/PERFORMANCE.md). All three are memory-bound: one
pass over the wide operand, the rank-r operand and the per-expert factor staying in L2. The floor they aim at, by
bytes moved at K3's EP8 shapes (16,352 rows, latent 3584, width 3072, r 32, bf16): ~0.85 GB for the adapter's
forward and ~1.2 GB for its backward, ~0.5 ms at the H200's measured 4.3 TB/s copy rate against the base's
8.6 ms forward+backward, i.e. ~6%. Measured on the H200 (``bench/gpu_lora_kernels.py``, CUDA-graph replays): each
kernel moves its bytes at 65-82% of a D2D copy's rate (two runs); the module's forward+backward is +8.2-9.2% over
the frozen experts' when calls run back to back, +10.2-10.4% timed from an idle device (3 runs; docs/PERFORMANCE.md).

Tiling. ``expand_add_`` and ``contract`` tile the rows by expert: a tile is ``BLOCK_M`` rows of one expert
(the last tile of an expert is partial). The tile -> (expert, row start, row end) schedule is built on the device
by ``tile_schedule`` from ``counts`` in one small Triton launch (no host sync; ``tile_schedule_reference`` is the
same in torch ops, ~20 launches); a layer builds it once (``RowTiles``) for its gate/up and down, forward and
backward. The grid is its upper bound
``cdiv(rows, BLOCK_M) + E`` and tiles past the last real one exit at once. ``expand_add_`` runs one program per
(row tile, ``BLOCK_N`` columns), the columns fastest so the programs running together share one ``B_e`` and one
``xa`` tile in L2; ``contract`` one program per row tile, looping over K in ``BLOCK_K`` steps. ``weight_grad`` runs
one program per (expert, ``[BLOCK_P, BLOCK_Q]`` output block), looping over the expert's rows (from the device
offsets; an expert without rows writes zeros). The rank-r dimension is one block padded to a power of two >= 16
(``tl.dot``'s minimum), masked.

Every kernel takes a *pair* of calls of one shape and strides in one launch (grid axis 1; the second call's tensors
as element offsets from the first's): gate and up run together, so a forward+backward launches 7 kernels, not 11.

``lora_gate_up`` / ``lora_down`` (autograd Functions, at the end) are ``LoRALatentExperts(lora_impl="triton")``:
the plain path's math with these kernels, backward written out, each running its frozen base grouped GEMM (torch's)
so the adapter is added into the base's output (forward) and into the base's input gradient (backward) in place.

Numerics: fp32 accumulation; bf16 (or fp16) in and out on CUDA with bf16 tensor-core products; fp32 in and out
with IEEE fp32 products (no TF32), so fp32 results equal a float32 reference up to summation order.

Runs on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (set before this module is imported: Triton
picks interpreted or compiled kernels when they are defined). Triton 3.6's interpreter multiplies bf16 ``tl.dot``
operands as their raw uint16 bit patterns (numpy has no bf16), so under the interpreter the kernels upcast them
to fp32 first. The plain-torch references sit next to each kernel (``*_reference``), as fla keeps ``naive.py``
beside ``chunk.py``. Triton 3.6's interpreter also needs numpy < 2.4 (triton-lang/triton#9171: a kernel's scalar
argument in ``range`` raises "only 0-dimensional arrays can be converted to Python scalars").

The default tiles are the swept ones' near-best (``bench/gpu_lora_kernels.py`` sweeps them: within 10% of the best
per kernel on the H200, and the module's time did not move with the tuned ones).
"""

from __future__ import annotations

import os

import torch

from k3.kernels.grouped_mm import grouped_mm, grouped_mm_reference, grouped_weight_grad_reference

__all__ = ["DEFAULT_BLOCKS", "KERNEL_CHOICES", "MAX_RANK", "check_kernel_choice", "contract", "contract_reference",
           "cpu_interpreter_problem", "expand_add_", "expand_add_reference", "kernels_run", "lora_down", "lora_fc1",
           "lora_gate_up", "RowTiles", "row_tiles", "tile_schedule", "tile_schedule_reference", "triton_available",
           "triton_runs_on", "weight_grad", "weight_grad_reference"]

# Tile sizes per kernel (powers of two; the rank-r dimension is never tiled), swept on the H200.
DEFAULT_BLOCKS = {
    "expand": {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3},
    "contract": {"block_m": 64, "block_k": 128, "num_warps": 4, "num_stages": 3},
    "weight_grad": {"block_m": 32, "block_wide": 128, "num_warps": 4, "num_stages": 4},
}
MAX_RANK = 256  # the rank-r dimension is one register block: beyond this it would spill
_MIN_DOT = 16  # tl.dot's smallest M/N/K


# ------------------------------------------------------------------------------------------------ Triton
try:  # the kernels are module-level: Triton resolves the helpers by their global names
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - ImportError, or a broken Triton install: the torch path serves
    triton = None

# Read once: Triton decides at decoration time (this import) whether the kernels are interpreted.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

if triton is not None:

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # acc + a @ b in fp32. IEEE: fp32 operands multiplied in full fp32 (TF32 would cost ~1e-3 relative).
        # UPCAST: the interpreter's bf16 dot is wrong (it multiplies the bit patterns), so multiply in fp32.
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _expand_add_kernel(out_ptr, xa_ptr, b_ptr, pair_out, pair_xa, pair_b, sched_ptr, n_tiles, N, R,
                           stride_om, stride_on, stride_xm, stride_xr, stride_be, stride_bn, stride_br,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # One program: BLOCK_M rows of one expert x BLOCK_N output columns. Columns vary fastest over the
        # program ids, so the programs in flight together read the same xa tile and the same B_e from L2.
        # Grid axis 1 picks the call of a pair: its tensors sit pair_* elements from the first call's.
        pair = tl.program_id(1).to(tl.int64)
        out_ptr += pair * pair_out
        xa_ptr += pair * pair_xa
        b_ptr += pair * pair_b
        pid = tl.program_id(0)
        n_blocks = tl.cdiv(N, BLOCK_N)
        tile, col_block = pid // n_blocks, pid % n_blocks
        expert = tl.load(sched_ptr + tile)
        if expert < 0:  # past the last real tile of the upper-bound grid
            return
        row_start = tl.load(sched_ptr + n_tiles + tile)
        row_end = tl.load(sched_ptr + 2 * n_tiles + tile)
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_R)
        row_ok, col_ok, k_ok = rows < row_end, cols < N, k < R
        rows64 = rows.to(tl.int64)  # [rows, N] offsets can pass 2^31
        xa = tl.load(xa_ptr + rows64[:, None] * stride_xm + k[None, :] * stride_xr,
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + expert.to(tl.int64) * stride_be + k[:, None] * stride_br + cols[None, :] * stride_bn,
                     mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # B_eᵀ tile, [BLOCK_R, BLOCK_N]
        out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_on
        mask = row_ok[:, None] & col_ok[None, :]
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)  # the epilogue add: one rounding
        acc = _dot(xa, bt, acc, IEEE, UPCAST)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _contract_kernel(h_ptr, a_ptr, out_ptr, pair_h, pair_a, pair_out, sched_ptr, n_tiles, K, R, scale,
                         stride_hm, stride_hk, stride_ae, stride_ar, stride_ak, stride_om, stride_or,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # One program: BLOCK_M rows of one expert, all r output columns, K in steps of BLOCK_K; axis 1: the pair.
        pair = tl.program_id(1).to(tl.int64)
        h_ptr += pair * pair_h
        a_ptr += pair * pair_a
        out_ptr += pair * pair_out
        tile = tl.program_id(0)
        expert = tl.load(sched_ptr + tile)
        if expert < 0:
            return
        row_start = tl.load(sched_ptr + n_tiles + tile)
        row_end = tl.load(sched_ptr + 2 * n_tiles + tile)
        rows = row_start + tl.arange(0, BLOCK_M)
        j = tl.arange(0, BLOCK_R)
        row_ok, j_ok = rows < row_end, j < R
        rows64 = rows.to(tl.int64)
        a_base = a_ptr + expert.to(tl.int64) * stride_ae
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            h = tl.load(h_ptr + rows64[:, None] * stride_hm + kk[None, :] * stride_hk,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_base + kk[:, None] * stride_ak + j[None, :] * stride_ar,
                         mask=k_ok[:, None] & j_ok[None, :], other=0.0)  # A_eᵀ tile, [BLOCK_K, BLOCK_R]
            acc = _dot(h, at, acc, IEEE, UPCAST)
        acc = acc * scale
        tl.store(out_ptr + rows64[:, None] * stride_om + j[None, :] * stride_or, acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & j_ok[None, :])

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

    @triton.jit
    def _weight_grad_kernel(a_ptr, b_ptr, out_ptr, pair_a, pair_b, pair_out, offs_ptr, P, Q,
                            stride_am, stride_ap, stride_bm, stride_bq, stride_oe, stride_op, stride_oq,
                            BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                            IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # One program: one [BLOCK_P, BLOCK_Q] block of W[e] = a_eᵀ b_e, summed over the expert's rows. The
        # blocks of one expert are consecutive program ids, so they share its rows in L2. Axis 1: the pair.
        pair = tl.program_id(1).to(tl.int64)
        a_ptr += pair * pair_a
        b_ptr += pair * pair_b
        out_ptr += pair * pair_out
        pid = tl.program_id(0)
        n_p, n_q = tl.cdiv(P, BLOCK_P), tl.cdiv(Q, BLOCK_Q)
        expert = pid // (n_p * n_q)
        block = pid % (n_p * n_q)
        p = (block // n_q) * BLOCK_P + tl.arange(0, BLOCK_P)
        q = (block % n_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        p_ok, q_ok = p < P, q < Q
        row_start = tl.load(offs_ptr + expert)
        row_end = tl.load(offs_ptr + expert + 1)
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        for m0 in range(row_start, row_end, BLOCK_M):  # no rows: no steps, the block is written as zeros
            rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            row_ok = rows < row_end
            at = tl.load(a_ptr + rows[None, :] * stride_am + p[:, None] * stride_ap,
                         mask=p_ok[:, None] & row_ok[None, :], other=0.0)  # a_eᵀ tile, [BLOCK_P, BLOCK_M]
            b = tl.load(b_ptr + rows[:, None] * stride_bm + q[None, :] * stride_bq,
                        mask=row_ok[:, None] & q_ok[None, :], other=0.0)
            acc = _dot(at, b, acc, IEEE, UPCAST)
        tl.store(out_ptr + expert.to(tl.int64) * stride_oe + p[:, None] * stride_op + q[None, :] * stride_oq,
                 acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


def triton_available() -> bool:
    """True when the kernels exist (running them also needs a CUDA device, or ``TRITON_INTERPRET=1``)."""
    return triton is not None


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether the kernels can run on tensors of ``device``: CUDA with Triton, or the CPU under the interpreter."""
    device = torch.device(device)
    if triton is None:
        return False
    if device.type == "cuda":
        return not _INTERPRETING  # the interpreter runs kernels on host memory only
    return device.type == "cpu" and _INTERPRETING


def cpu_interpreter_problem() -> str | None:
    """Why the kernels cannot run on the CPU here (for a test's skip reason), or None: it runs the smallest call."""
    if triton is None:
        return "Triton is not importable (CI's venv has none); run under TRITON_INTERPRET=1 in a venv with Triton"
    if not _INTERPRETING:
        return "TRITON_INTERPRET=1 is not set: the kernels run on the CPU only under Triton's interpreter"
    try:  # Triton 3.6's interpreter breaks on numpy >= 2.4 (triton-lang/triton#9171)
        contract(torch.ones(1, 16), torch.ones(1, 2, 16), torch.tensor([1]))
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"Triton's interpreter fails here ({type(e).__name__}: {str(e)[:120]}; numpy < 2.4 needed for 3.6)"
    return None


# How an expert adapter runs its rank-r grouped GEMMs: ``auto`` = ``triton`` where the kernels run (CUDA with
# Triton) and no dropout mask is active, else ``torch``; ``triton`` insists (an error where it cannot run).
KERNEL_CHOICES = ("auto", "torch", "triton")


def check_kernel_choice(kernel: str, flag: str = "lora_impl") -> None:
    """A ValueError naming ``flag`` unless ``kernel`` is one of ``KERNEL_CHOICES`` and, for ``triton``, Triton
    imports here (whether it can run on a given device is ``kernels_run``'s question)."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"{flag}={kernel!r}: expected one of {KERNEL_CHOICES}")
    if kernel == "triton" and not triton_available():
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
        return triton_runs_on(device)
    if not triton_runs_on(device):
        raise ValueError(f"{flag}='triton': the Triton kernels cannot run on {torch.device(device)} here (they need "
                         f"a CUDA device, or the CPU under TRITON_INTERPRET=1); use {flag}='torch'")
    return True


# ------------------------------------------------------------------------------------------------ checks
def _require_triton(name: str, *tensors: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(f"{name}: needs Triton (pip install triton) and a CUDA device; without them use the "
                           "torch path (LoRALatentExperts(lora_impl='torch'))")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"{name}: tensors on {sorted({str(t.device) for t in tensors})}: expected one device")
    if not triton_runs_on(device):
        where = ("a CUDA device (or on the CPU under TRITON_INTERPRET=1, set before k3.kernels.lora_grouped is "
                 "imported)")
        raise ValueError(f"{name}: the Triton kernels run on {where}, not on {device}"
                         + (" while TRITON_INTERPRET=1" if _INTERPRETING else ""))


def _check_dtypes(name: str, **tensors: torch.Tensor) -> torch.dtype:
    dtypes = {n: t.dtype for n, t in tensors.items()}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"{name}: dtypes {dtypes}: expected one dtype")
    dtype = next(iter(dtypes.values()))
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: dtype {dtype}: expected float32, bfloat16 or float16")
    return dtype


def _check_counts(name: str, counts: torch.Tensor, experts: int, rows: int) -> None:
    if counts.dim() != 1 or counts.shape[0] != experts or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"{name}: counts {tuple(counts.shape)} {counts.dtype}: expected [E] = [{experts}] integer")
    if experts < 1:
        raise ValueError(f"{name}: no experts (E = 0)")
    if not counts.is_cuda:  # a device sync on CUDA; on the CPU cheap, and a wrong count would drop rows silently
        total = int(counts.sum())
        if total != rows or bool((counts < 0).any()):
            raise ValueError(f"{name}: counts sum to {total} (min {int(counts.min())}): expected non-negative "
                             f"counts summing to the {rows} rows")


def _check_rank(name: str, r: int) -> None:
    if not 1 <= r <= MAX_RANK:
        raise ValueError(f"{name}: rank {r}: the kernels take 1 <= r <= {MAX_RANK}")


def _flags(dtype: torch.dtype) -> dict[str, bool]:
    return {"IEEE": dtype == torch.float32, "UPCAST": _INTERPRETING and dtype != torch.float32}


def _pow2_block(n: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(n))


def _blocks(kernel: str, **given: int | None) -> list[int]:
    """The given tile sizes, ``DEFAULT_BLOCKS[kernel]``'s where None (read per call: the bench sweeps them)."""
    return [DEFAULT_BLOCKS[kernel][k] if v is None else v for k, v in given.items()]


def _check_block(name: str, **blocks: int) -> None:
    for key, v in blocks.items():
        if v < _MIN_DOT or v & (v - 1):
            raise ValueError(f"{name}: {key}={v}: expected a power of two >= {_MIN_DOT}")


# ------------------------------------------------------------------------------------------------ schedule
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
    if triton_runs_on(counts.device):
        return row_tiles(counts, rows, block_m)[0]
    return tile_schedule_reference(counts, rows, block_m)


def tile_schedule_reference(counts: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """``tile_schedule`` in torch ops (about 20 launches on CUDA): the plain reference of ``_schedule_kernel``."""
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


def _schedule_block_t(block_e: int) -> int:
    """Tiles per program of the schedule kernel: [BLOCK_T, BLOCK_E] one-hot blocks of at most 2048 entries."""
    return max(2, min(16, 2048 // block_e))


def row_tiles(counts: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile_schedule(counts, rows, block_m), offsets)`` from one Triton launch (offsets: ``_offsets(counts)``).

    Needs the kernels to run on ``counts``' device; ``counts`` is ``[E]`` integer, ``E <= 4096`` (one block), with
    fewer than 2^31 rows.
    """
    E = counts.shape[0]
    if E > 4096:
        raise ValueError(f"row_tiles: {E} experts: the schedule kernel holds them in one block (<= 4096)")
    n_tiles = -(-rows // block_m) + E
    sched = torch.empty(3, n_tiles, dtype=torch.int32, device=counts.device)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=counts.device)
    block_e = _pow2_block(E)
    block_t = _schedule_block_t(block_e)
    _schedule_kernel[(triton.cdiv(n_tiles, block_t),)](counts, sched, offsets, E, n_tiles, BLOCK_M=block_m,
                                                      BLOCK_E=block_e, BLOCK_T=block_t)
    return sched, offsets


def _schedule_for(name: str, schedule: torch.Tensor | None, counts: torch.Tensor, rows: int,
                  block_m: int) -> torch.Tensor:
    """``schedule`` if given (its length must be that of ``block_m``'s schedule), else a new one."""
    if schedule is None:
        return tile_schedule(counts, rows, block_m)
    want = (3, -(-rows // block_m) + counts.shape[0])
    if tuple(schedule.shape) != want or schedule.dtype != torch.int32 or schedule.device != counts.device:
        raise ValueError(f"{name}: schedule {tuple(schedule.shape)} {schedule.dtype} on {schedule.device}: expected "
                         f"tile_schedule(counts, {rows}, block_m={block_m}), {want} int32 on {counts.device}")
    return schedule


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """``[E + 1]`` int32: ``[0, cumsum(counts)]`` (expert e's rows are ``offs[e]:offs[e + 1]``)."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


# ------------------------------------------------------------------------------------------------ kernels
Pair = tuple[torch.Tensor, torch.Tensor]  # two calls' operands of one shape and strides: one launch for both


def _pairs(name: str, **operands: torch.Tensor | Pair) -> tuple[dict[str, torch.Tensor], list[int], int]:
    """Operands given as tensors (one call) or all as pairs (two calls, one launch): the first call's tensors,
    each second tensor's offset from its first in elements (zeros for one call), and the number of calls."""
    paired = {k: isinstance(v, (tuple, list)) for k, v in operands.items()}
    if not any(paired.values()):
        return dict(operands), [0] * len(operands), 1
    if not all(paired.values()) or any(len(v) != 2 for v in operands.values()):
        raise ValueError(f"{name}: {', '.join(operands)}: give each a tensor (one call) or each a pair (two calls)")
    firsts, offsets = {}, []
    for k, (t1, t2) in operands.items():
        if t1.shape != t2.shape or t1.stride() != t2.stride() or t1.dtype != t2.dtype or t1.device != t2.device:
            raise ValueError(f"{name}: {k} pair {tuple(t1.shape)}/{tuple(t2.shape)}, strides {t1.stride()}/"
                             f"{t2.stride()}, {t1.dtype}/{t2.dtype}: a pair needs one shape, strides, dtype, device")
        firsts[k] = t1
        offsets.append((t2.data_ptr() - t1.data_ptr()) // t1.element_size())  # same dtype: always divisible
    return firsts, offsets, 2


def expand_add_(out: torch.Tensor | Pair, xa: torch.Tensor | Pair, B: torch.Tensor | Pair, counts: torch.Tensor, *,
                schedule: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor | Pair:
    """``out[i] += xa[i] @ B[e(i)]ᵀ`` in place, for expert-sorted rows: the LoRA up-projection with its add.

    Args:
        out: ``[rows, N]`` (any strides), updated in place.
        xa: ``[rows, r]`` (any strides; a column slice is fine), the rank-r rows (scale already applied).
        B: ``[E, N, r]`` (any strides: ``A.transpose(1, 2)`` of an ``[E, r, N]`` factor is fine).
            ``out``, ``xa`` and ``B`` may each be a pair (gate and up, say): two calls in one launch, each pair's
            tensors of one shape and strides.
        counts: ``[E]`` integer rows per expert, on ``out``'s device, summing to rows (checked on the CPU only).
        schedule: ``tile_schedule(counts, rows, block_m)``, to share one between calls.
        block_m, block_n, num_warps, num_stages: the tile (powers of two; block_m, block_n >= 16) and Triton's
            launch options; None: ``DEFAULT_BLOCKS``.

    Returns:
        ``out``. Same dtype for all three (fp32 accumulation).
    """
    name = "expand_add_"
    given = out
    t, pair_offsets, calls = _pairs(name, out=out, xa=xa, B=B)
    out, xa, B = t["out"], t["xa"], t["B"]
    if out.dim() != 2 or xa.dim() != 2 or B.dim() != 3 or out.shape[0] != xa.shape[0] \
            or B.shape[1] != out.shape[1] or B.shape[2] != xa.shape[1]:
        raise ValueError(f"{name}: out {tuple(out.shape)}, xa {tuple(xa.shape)}, B {tuple(B.shape)}: expected "
                         "out [rows, N], xa [rows, r], B [E, N, r]")
    dtype = _check_dtypes(name, out=out, xa=xa, B=B)
    _check_rank(name, xa.shape[1])
    _check_counts(name, counts, B.shape[0], out.shape[0])
    _require_triton(name, out, xa, B, counts)
    block_m, block_n, num_warps, num_stages = _blocks("expand", block_m=block_m, block_n=block_n,
                                                      num_warps=num_warps, num_stages=num_stages)
    _check_block(name, block_m=block_m, block_n=block_n)
    rows, N = out.shape
    if rows == 0 or N == 0:
        return given
    schedule = _schedule_for(name, schedule, counts, rows, block_m)
    n_tiles = schedule.shape[1]
    grid = (n_tiles * triton.cdiv(N, block_n), calls)
    _expand_add_kernel[grid](out, xa, B, *pair_offsets, schedule, n_tiles, N, xa.shape[1], *out.stride(),
                             *xa.stride(), *B.stride(), BLOCK_M=block_m, BLOCK_N=block_n,
                             BLOCK_R=_pow2_block(xa.shape[1]), **_flags(dtype), num_warps=num_warps,
                             num_stages=num_stages)
    return given


def expand_add_reference(out: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out + grouped(xa, B)`` in plain torch (a new tensor), for tests."""
    return out + grouped_mm_reference(xa, B, counts)


def contract(h: torch.Tensor | Pair, A: torch.Tensor | Pair, counts: torch.Tensor, scale: float = 1.0, *,
             out: torch.Tensor | Pair | None = None, schedule: torch.Tensor | None = None, block_m: int | None = None,
             block_k: int | None = None, num_warps: int | None = None,
             num_stages: int | None = None) -> torch.Tensor | Pair:
    """``scale · h[i] @ A[e(i)]ᵀ`` for expert-sorted rows: the per-expert LoRA down-projection to rank r.

    Args:
        h: ``[rows, K]`` (any strides).
        A: ``[E, r, K]`` (any strides: ``B.transpose(1, 2)`` of an ``[E, K, r]`` factor is fine).
        counts: ``[E]`` integer rows per expert, on ``h``'s device, summing to rows (checked on the CPU only).
        scale: multiplies the result (fp32, before the output rounding).
        out: ``[rows, r]`` to write into (any strides, e.g. a column slice); a new tensor when None. ``h``, ``A``
            and ``out`` may each be a pair (two calls in one launch; ``out`` then given as a pair too).
        schedule: ``tile_schedule(counts, rows, block_m)``, to share one between calls.
        block_m, block_k, num_warps, num_stages: the tile (powers of two; block_m, block_k >= 16) and Triton's
            launch options; None: ``DEFAULT_BLOCKS``.

    Returns:
        ``[rows, r]`` in ``h``'s dtype (fp32 accumulation), or the pair ``out``.
    """
    name = "contract"
    if isinstance(h, (tuple, list)) and out is None:
        raise ValueError(f"{name}: a pair of calls writes into a given pair of outputs (out=)")
    h0, A0 = (h[0], A[0]) if isinstance(h, (tuple, list)) and isinstance(A, (tuple, list)) else (h, A)
    if not isinstance(h0, torch.Tensor) or not isinstance(A0, torch.Tensor) or h0.dim() != 2 or A0.dim() != 3 \
            or A0.shape[2] != h0.shape[1]:
        raise ValueError(f"{name}: h {_shape(h)}, A {_shape(A)}: expected h [rows, K], A [E, r, K]")
    if out is None:
        out = h0.new_empty(h0.shape[0], A0.shape[1])
    given = out
    t, pair_offsets, calls = _pairs(name, h=h, A=A, out=out)
    h, A, out = t["h"], t["A"], t["out"]  # the first call's: their shapes were checked above
    rows, K = h.shape
    r = A.shape[1]
    if tuple(out.shape) != (rows, r):
        raise ValueError(f"{name}: out {tuple(out.shape)}: expected [rows, r] = [{rows}, {r}]")
    dtype = _check_dtypes(name, h=h, A=A, out=out)
    _check_rank(name, r)
    _check_counts(name, counts, A.shape[0], rows)
    _require_triton(name, h, A, out, counts)
    block_m, block_k, num_warps, num_stages = _blocks("contract", block_m=block_m, block_k=block_k,
                                                      num_warps=num_warps, num_stages=num_stages)
    _check_block(name, block_m=block_m, block_k=block_k)
    if rows == 0:
        return given
    if K == 0:
        for o in (given if calls == 2 else (given,)):
            o.zero_()
        return given
    schedule = _schedule_for(name, schedule, counts, rows, block_m)
    n_tiles = schedule.shape[1]
    _contract_kernel[(n_tiles, calls)](h, A, out, *pair_offsets, schedule, n_tiles, K, r, float(scale), *h.stride(),
                                       *A.stride(), *out.stride(), BLOCK_M=block_m, BLOCK_K=block_k,
                                       BLOCK_R=_pow2_block(r), **_flags(dtype), num_warps=num_warps,
                                       num_stages=num_stages)
    return given


def _shape(t: torch.Tensor | Pair) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else [tuple(x.shape) for x in t]


def contract_reference(h: torch.Tensor, A: torch.Tensor, counts: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · grouped(h, A)`` in plain torch, for tests."""
    return grouped_mm_reference(h, A, counts) * scale


def weight_grad(a: torch.Tensor | Pair, b: torch.Tensor | Pair, counts: torch.Tensor, *,
                offsets: torch.Tensor | None = None, block_m: int | None = None, block_wide: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor | Pair:
    """Per-expert ``a_eᵀ b_e`` of expert-sorted rows: a LoRA factor's gradient, grouped along the rows.

    ``dB[e] = weight_grad(dgate, xa)`` (``[E, N, r]``), ``dA[e] = weight_grad(dha, h)`` (``[E, r, K]``).

    Args:
        a: ``[rows, P]``, b: ``[rows, Q]`` (any strides), the same rows, sorted by expert; or both pairs (two
            calls in one launch, each pair's tensors of one shape and strides).
        counts: ``[E]`` integer rows per expert, on ``a``'s device, summing to rows (checked on the CPU only).
        offsets: ``[E + 1]`` int32 ``[0, cumsum(counts)]`` (``row_tiles``' second output), to share one.
        block_m: rows per reduction step; block_wide: the output tile along P or Q where it is wider than 64
            (a dimension up to 64 is one block); num_warps, num_stages: Triton's launch options (block_m and
            block_wide powers of two >= 16); None: ``DEFAULT_BLOCKS``.

    Returns:
        ``[E, P, Q]`` in ``a``'s dtype (fp32 accumulation), zeros for an expert without rows; a pair for pairs.
    """
    name = "weight_grad"
    t, pair_offsets, calls = _pairs(name, a=a, b=b)
    a, b = t["a"], t["b"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"{name}: a {tuple(a.shape)}, b {tuple(b.shape)}: expected [rows, P] and [rows, Q] with "
                         "the same rows")
    dtype = _check_dtypes(name, a=a, b=b)
    rows, P = a.shape
    Q = b.shape[1]
    E = counts.shape[0] if counts.dim() == 1 else -1
    _check_counts(name, counts, E, rows)
    _require_triton(name, a, b, counts)
    block_m, block_wide, num_warps, num_stages = _blocks("weight_grad", block_m=block_m, block_wide=block_wide,
                                                         num_warps=num_warps, num_stages=num_stages)
    _check_block(name, block_m=block_m, block_wide=block_wide)
    both = a.new_empty(calls, E, P, Q)  # one allocation: the pair's outputs sit E·P·Q elements apart
    outs = tuple(both.unbind(0))
    if both.numel() == 0:
        return outs if calls == 2 else outs[0]
    if offsets is None:
        offsets = _offsets(counts)
    elif tuple(offsets.shape) != (E + 1,) or offsets.dtype != torch.int32 or offsets.device != counts.device:
        raise ValueError(f"{name}: offsets {tuple(offsets.shape)} {offsets.dtype} on {offsets.device}: expected "
                         f"[E + 1] = [{E + 1}] int32 on {counts.device}")
    block_p = _pow2_block(P) if P <= 64 else block_wide
    block_q = _pow2_block(Q) if Q <= 64 else block_wide
    out = outs[0]
    grid = (E * triton.cdiv(P, block_p) * triton.cdiv(Q, block_q), calls)
    _weight_grad_kernel[grid](a, b, out, *pair_offsets, out.numel(), offsets, P, Q, *a.stride(), *b.stride(),
                              *out.stride(), BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_Q=block_q, **_flags(dtype),
                              num_warps=num_warps, num_stages=num_stages)
    return outs if calls == 2 else outs[0]


def weight_grad_reference(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The plain per-expert loop (``grouped_weight_grad_reference``), for tests."""
    return grouped_weight_grad_reference(a, b, counts)


# ------------------------------------------------------------------------------------------------ autograd
# The routed experts' gate/up and down with shared-outer LoRA (k3/lora/experts.py's plain-path math), the rank-r
# grouped parts on the kernels above. Each Function runs its base grouped GEMM too (torch's, frozen weights: no
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
    _check_dtypes(name, **tensors)
    _require_triton(name, rows, *tensors.values())
    _check_counts(name, counts, counts.shape[0] if counts.dim() == 1 else -1, rows.shape[0])


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
