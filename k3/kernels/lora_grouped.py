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
8.6 ms forward+backward, i.e. ~6% (an estimate from the shapes; what the kernels reach is for a lease to measure).

Tiling. ``expand_add_`` and ``contract`` tile the rows by expert: a tile is ``BLOCK_M`` rows of one expert
(the last tile of an expert is partial). The tile -> (expert, row start, row end) schedule is built on the device
by ``tile_schedule`` from ``counts`` with torch ops (no host sync); the grid is its upper bound
``cdiv(rows, BLOCK_M) + E`` and tiles past the last real one exit at once. ``expand_add_`` runs one program per
(row tile, ``BLOCK_N`` columns), the columns fastest so the programs running together share one ``B_e`` and one
``xa`` tile in L2; ``contract`` one program per row tile, looping over K in ``BLOCK_K`` steps. ``weight_grad`` runs
one program per (expert, ``[BLOCK_P, BLOCK_Q]`` output block), looping over the expert's rows (from the device
offsets; an expert without rows writes zeros). The rank-r dimension is one block padded to a power of two >= 16
(``tl.dot``'s minimum), masked.

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

Unmeasured on the GPU so far (checked: the interpreter tests, and that all three kernels compile to sm_90 cubins with
Triton 3.6, bf16 on tensor-core MMA); the block sizes are first guesses, swept by ``bench/gpu_expert_lora.py``.
"""

from __future__ import annotations

import os

import torch

from k3.kernels.grouped_mm import grouped_mm, grouped_mm_reference, grouped_weight_grad_reference

__all__ = ["DEFAULT_BLOCKS", "KERNEL_CHOICES", "MAX_RANK", "check_kernel_choice", "contract", "contract_reference",
           "cpu_interpreter_problem", "expand_add_", "expand_add_reference", "kernels_run", "lora_down", "lora_fc1",
           "lora_gate_up", "tile_schedule", "triton_available", "triton_runs_on", "weight_grad",
           "weight_grad_reference"]

# Tile sizes per kernel (powers of two; the rank-r dimension is never tiled). First guesses, not measured yet.
DEFAULT_BLOCKS = {
    "expand": {"block_m": 64, "block_n": 128, "num_warps": 4},
    "contract": {"block_m": 64, "block_k": 128, "num_warps": 4},
    "weight_grad": {"block_m": 64, "block_wide": 128, "num_warps": 4},
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
    def _expand_add_kernel(out_ptr, xa_ptr, b_ptr, sched_ptr, n_tiles, N, R,
                           stride_om, stride_on, stride_xm, stride_xr, stride_be, stride_bn, stride_br,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # One program: BLOCK_M rows of one expert x BLOCK_N output columns. Columns vary fastest over the
        # program ids, so the programs in flight together read the same xa tile and the same B_e from L2.
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
    def _contract_kernel(h_ptr, a_ptr, out_ptr, sched_ptr, n_tiles, K, R, scale,
                         stride_hm, stride_hk, stride_ae, stride_ar, stride_ak, stride_om, stride_or,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # One program: BLOCK_M rows of one expert, all r output columns, K in steps of BLOCK_K.
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
    def _weight_grad_kernel(a_ptr, b_ptr, out_ptr, offs_ptr, P, Q,
                            stride_am, stride_ap, stride_bm, stride_bq, stride_oe, stride_op, stride_oq,
                            BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                            IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # One program: one [BLOCK_P, BLOCK_Q] block of W[e] = a_eᵀ b_e, summed over the expert's rows. The
        # blocks of one expert are consecutive program ids, so they share its rows in L2.
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


KERNEL_CHOICES = ("torch", "triton")  # how an expert adapter runs its rank-r grouped GEMMs


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
    the kernels run on ``device``; a ValueError naming ``flag`` where ``triton`` was asked for and they cannot.
    """
    if kernel == "torch" or dropout_active:
        return False
    check_kernel_choice(kernel, flag)
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
        real one. Experts without rows get no tile.
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
def expand_add_(out: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, counts: torch.Tensor, *,
                schedule: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """``out[i] += xa[i] @ B[e(i)]ᵀ`` in place, for expert-sorted rows: the LoRA up-projection with its add.

    Args:
        out: ``[rows, N]`` (any strides), updated in place.
        xa: ``[rows, r]`` (any strides; a column slice is fine), the rank-r rows (scale already applied).
        B: ``[E, N, r]`` (any strides: ``A.transpose(1, 2)`` of an ``[E, r, N]`` factor is fine).
        counts: ``[E]`` integer rows per expert, on ``out``'s device, summing to rows (checked on the CPU only).
        schedule: ``tile_schedule(counts, rows, block_m)``, to share one between calls.
        block_m, block_n, num_warps: the tile (powers of two; block_m, block_n >= 16); None: ``DEFAULT_BLOCKS``.

    Returns:
        ``out``. Same dtype for all three (fp32 accumulation).
    """
    name = "expand_add_"
    if out.dim() != 2 or xa.dim() != 2 or B.dim() != 3 or out.shape[0] != xa.shape[0] \
            or B.shape[1] != out.shape[1] or B.shape[2] != xa.shape[1]:
        raise ValueError(f"{name}: out {tuple(out.shape)}, xa {tuple(xa.shape)}, B {tuple(B.shape)}: expected "
                         "out [rows, N], xa [rows, r], B [E, N, r]")
    dtype = _check_dtypes(name, out=out, xa=xa, B=B)
    _check_rank(name, xa.shape[1])
    _check_counts(name, counts, B.shape[0], out.shape[0])
    _require_triton(name, out, xa, B, counts)
    block_m, block_n, num_warps = _blocks("expand", block_m=block_m, block_n=block_n, num_warps=num_warps)
    _check_block(name, block_m=block_m, block_n=block_n)
    rows, N = out.shape
    if rows == 0 or N == 0:
        return out
    schedule = _schedule_for(name, schedule, counts, rows, block_m)
    n_tiles = schedule.shape[1]
    grid = (n_tiles * triton.cdiv(N, block_n),)
    _expand_add_kernel[grid](out, xa, B, schedule, n_tiles, N, xa.shape[1], *out.stride(), *xa.stride(),
                             *B.stride(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_pow2_block(xa.shape[1]),
                             **_flags(dtype), num_warps=num_warps)
    return out


def expand_add_reference(out: torch.Tensor, xa: torch.Tensor, B: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out + grouped(xa, B)`` in plain torch (a new tensor), for tests."""
    return out + grouped_mm_reference(xa, B, counts)


def contract(h: torch.Tensor, A: torch.Tensor, counts: torch.Tensor, scale: float = 1.0, *,
             out: torch.Tensor | None = None, schedule: torch.Tensor | None = None, block_m: int | None = None,
             block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``scale · h[i] @ A[e(i)]ᵀ`` for expert-sorted rows: the per-expert LoRA down-projection to rank r.

    Args:
        h: ``[rows, K]`` (any strides).
        A: ``[E, r, K]`` (any strides: ``B.transpose(1, 2)`` of an ``[E, K, r]`` factor is fine).
        counts: ``[E]`` integer rows per expert, on ``h``'s device, summing to rows (checked on the CPU only).
        scale: multiplies the result (fp32, before the output rounding).
        out: ``[rows, r]`` to write into (any strides, e.g. a column slice); a new tensor when None.
        schedule: ``tile_schedule(counts, rows, block_m)``, to share one between calls.
        block_m, block_k, num_warps: the tile (powers of two; block_m, block_k >= 16); None: ``DEFAULT_BLOCKS``.

    Returns:
        ``[rows, r]`` in ``h``'s dtype (fp32 accumulation).
    """
    name = "contract"
    if h.dim() != 2 or A.dim() != 3 or A.shape[2] != h.shape[1]:
        raise ValueError(f"{name}: h {tuple(h.shape)}, A {tuple(A.shape)}: expected h [rows, K], A [E, r, K]")
    rows, K = h.shape
    r = A.shape[1]
    if out is None:
        out = h.new_empty(rows, r)
    elif tuple(out.shape) != (rows, r):
        raise ValueError(f"{name}: out {tuple(out.shape)}: expected [rows, r] = [{rows}, {r}]")
    dtype = _check_dtypes(name, h=h, A=A, out=out)
    _check_rank(name, r)
    _check_counts(name, counts, A.shape[0], rows)
    _require_triton(name, h, A, out, counts)
    block_m, block_k, num_warps = _blocks("contract", block_m=block_m, block_k=block_k, num_warps=num_warps)
    _check_block(name, block_m=block_m, block_k=block_k)
    if rows == 0:
        return out
    if K == 0:
        return out.zero_()
    schedule = _schedule_for(name, schedule, counts, rows, block_m)
    n_tiles = schedule.shape[1]
    _contract_kernel[(n_tiles,)](h, A, out, schedule, n_tiles, K, r, float(scale), *h.stride(), *A.stride(),
                                 *out.stride(), BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_pow2_block(r),
                                 **_flags(dtype), num_warps=num_warps)
    return out


def contract_reference(h: torch.Tensor, A: torch.Tensor, counts: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · grouped(h, A)`` in plain torch, for tests."""
    return grouped_mm_reference(h, A, counts) * scale


def weight_grad(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, *,
                block_m: int | None = None, block_wide: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """Per-expert ``a_eᵀ b_e`` of expert-sorted rows: a LoRA factor's gradient, grouped along the rows.

    ``dB[e] = weight_grad(dgate, xa)`` (``[E, N, r]``), ``dA[e] = weight_grad(dha, h)`` (``[E, r, K]``).

    Args:
        a: ``[rows, P]``, b: ``[rows, Q]`` (any strides), the same rows, sorted by expert.
        counts: ``[E]`` integer rows per expert, on ``a``'s device, summing to rows (checked on the CPU only).
        block_m: rows per reduction step; block_wide: the output tile along P or Q where it is wider than 64
            (a dimension up to 64 is one block); num_warps (powers of two; block_m, block_wide >= 16); None:
            ``DEFAULT_BLOCKS``.

    Returns:
        ``[E, P, Q]`` in ``a``'s dtype (fp32 accumulation); zeros for an expert without rows.
    """
    name = "weight_grad"
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"{name}: a {tuple(a.shape)}, b {tuple(b.shape)}: expected [rows, P] and [rows, Q] with "
                         "the same rows")
    dtype = _check_dtypes(name, a=a, b=b)
    rows, P = a.shape
    Q = b.shape[1]
    E = counts.shape[0] if counts.dim() == 1 else -1
    _check_counts(name, counts, E, rows)
    _require_triton(name, a, b, counts)
    block_m, block_wide, num_warps = _blocks("weight_grad", block_m=block_m, block_wide=block_wide,
                                             num_warps=num_warps)
    _check_block(name, block_m=block_m, block_wide=block_wide)
    out = a.new_empty(E, P, Q)
    if out.numel() == 0:
        return out
    block_p = _pow2_block(P) if P <= 64 else block_wide
    block_q = _pow2_block(Q) if Q <= 64 else block_wide
    grid = (E * triton.cdiv(P, block_p) * triton.cdiv(Q, block_q),)
    _weight_grad_kernel[grid](a, b, out, _offsets(counts), P, Q, *a.stride(), *b.stride(), *out.stride(),
                              BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_Q=block_q, **_flags(dtype),
                              num_warps=num_warps)
    return out


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
class _Schedules:
    """The tile schedules of one counts tensor, built on first use per ``block_m`` (forward and backward share)."""

    def __init__(self, counts: torch.Tensor, rows: int) -> None:
        self.counts, self.rows, self._by_block = counts, rows, {}

    def get(self, kernel: str) -> torch.Tensor:
        block_m = DEFAULT_BLOCKS[kernel]["block_m"]
        if block_m not in self._by_block:
            self._by_block[block_m] = tile_schedule(self.counts, self.rows, block_m)
        return self._by_block[block_m]


class _GateUpLoRA(torch.autograd.Function):
    """Gate and up with shared-A LoRA. ``w3`` None: ``w1`` is megatron's fc1 weight ``[E, 2F, Lt]`` (gate rows,
    then up rows) and the output one ``[rows, 2F]`` tensor whose halves the kernels update as column views; else
    ``w1``/``w3`` are ``[E, F, Lt]`` each and the output ``(gate, up)``."""

    @staticmethod
    def forward(ctx, x, A, B1, B3, w1, w3, counts, scale):
        r, F_ = B1.shape[2], B1.shape[1]
        xa = (x @ A.T).mul_(scale)  # [rows, 2r]: the scale on the narrow product
        sched = _Schedules(counts, x.shape[0])
        if w3 is None:
            out = grouped_mm(x, w1, counts)  # [rows, 2F]: one base GEMM for both halves
            gate, up = out[:, :F_], out[:, F_:]
        else:
            gate, up = grouped_mm(x, w1, counts), grouped_mm(x, w3, counts)
        expand_add_(gate, xa[:, :r], B1, counts, schedule=sched.get("expand"))
        expand_add_(up, xa[:, r:], B3, counts, schedule=sched.get("expand"))
        ctx.save_for_backward(x, xa, A, B1, B3, w1, w3, counts)
        ctx.scale, ctx.sched = scale, sched
        return out if w3 is None else (gate, up)

    @staticmethod
    def backward(ctx, *grads):
        x, xa, A, B1, B3, w1, w3, counts = ctx.saved_tensors
        need_x, need_A, need_B1, need_B3 = ctx.needs_input_grad[:4]
        r, F_, s, sched = B1.shape[2], B1.shape[1], ctx.scale, ctx.sched
        # contiguous: torch's grouped GEMM rejects stride-0 gradients (an expanded ones_like, say)
        if w3 is None:
            dout = grads[0].contiguous()
            dgate, dup = dout[:, :F_], dout[:, F_:]
        else:
            dgate, dup = grads[0].contiguous(), grads[1].contiguous()
        dx = dA = dB1 = dB3 = None
        if need_x or need_A:
            dxa = xa.new_empty(xa.shape)  # d(x Aᵀ) = s · [dgate B1_e | dup B3_e], [rows, 2r]
            contract(dgate, B1.transpose(1, 2), counts, s, out=dxa[:, :r], schedule=sched.get("contract"))
            contract(dup, B3.transpose(1, 2), counts, s, out=dxa[:, r:], schedule=sched.get("contract"))
            if need_x:
                if w3 is None:
                    dx = grouped_mm(dout, w1.transpose(1, 2), counts)
                else:
                    dx = grouped_mm(dgate, w1.transpose(1, 2), counts)
                    dx += grouped_mm(dup, w3.transpose(1, 2), counts)
                dx.addmm_(dxa, A)
            if need_A:
                dA = dxa.T @ x
        if need_B1:
            dB1 = weight_grad(dgate, xa[:, :r], counts)
        if need_B3:
            dB3 = weight_grad(dup, xa[:, r:], counts)
        return dx, dA, dB1, dB3, None, None, None, None


class _DownLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, A2, B2, w2, counts, scale):
        sched = _Schedules(counts, h.shape[0])
        out = grouped_mm(h, w2, counts)  # [rows, Lt]
        ha = contract(h, A2, counts, schedule=sched.get("contract"))  # [rows, r]
        out.addmm_(ha, B2.T, alpha=scale)  # the shared B: an ordinary GEMM, added in place
        ctx.save_for_backward(h, ha, A2, B2, w2, counts)
        ctx.scale, ctx.sched = scale, sched
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
            expand_add_(dh, dha, A2.transpose(1, 2), counts, schedule=ctx.sched.get("expand"))
        if need_A2:
            dA2 = weight_grad(dha, h, counts)  # [E, r, F]
        if need_B2:
            dB2 = (dout.T @ ha).mul_(s)  # [Lt, r]
        return dh, dA2, dB2, None, None, None


def _check_module_inputs(name: str, rows: torch.Tensor, counts: torch.Tensor, **tensors: torch.Tensor) -> None:
    _check_dtypes(name, **tensors)
    _require_triton(name, rows, *tensors.values())
    _check_counts(name, counts, counts.shape[0] if counts.dim() == 1 else -1, rows.shape[0])


def lora_gate_up(x: torch.Tensor, A: torch.Tensor, B1: torch.Tensor, B3: torch.Tensor, w1: torch.Tensor,
                 w3: torch.Tensor, counts: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up projections of expert-sorted rows with shared-A LoRA, the rank-r parts on the Triton kernels.

    ``gate = grouped(x, w1) + grouped(s · x A1ᵀ, B1)`` (up likewise with w3, A3, B3), as
    ``LoRALatentExperts.gate_up``'s plain path; gradients for x, A, B1 and B3, none for the frozen w1/w3.

    Args:
        x: ``[rows, Lt]`` sorted by expert. A: ``[2r, Lt]`` = ``[w1_lora_A; w3_lora_A]``.
        B1, B3: ``[E, F, r]``. w1, w3: ``[E, F, Lt]`` (frozen). counts: ``[E]`` rows per expert (moved to x's
            device). scale: ``alpha / r``.

    Returns:
        ``(gate, up)``, each ``[rows, F]`` in x's dtype.
    """
    counts = counts.to(x.device)
    if A.dim() != 2 or B1.dim() != 3 or B1.shape != B3.shape or A.shape != (2 * B1.shape[2], x.shape[1]):
        raise ValueError(f"lora_gate_up: A {tuple(A.shape)}, B1 {tuple(B1.shape)}, B3 {tuple(B3.shape)} for x "
                         f"{tuple(x.shape)}: expected A [2r, Lt], B1 and B3 [E, F, r]")
    _check_module_inputs("lora_gate_up", x, counts, x=x, A=A, B1=B1, B3=B3, w1=w1, w3=w3)
    return _GateUpLoRA.apply(x, A, B1, B3, w1, w3, counts, float(scale))


def lora_fc1(x: torch.Tensor, A: torch.Tensor, B1: torch.Tensor, B3: torch.Tensor, w13: torch.Tensor,
             counts: torch.Tensor, scale: float) -> torch.Tensor:
    """``lora_gate_up`` on megatron's fc1 layout: one stacked base weight, one ``[rows, 2F]`` output.

    ``out = [gate | up]`` with ``gate``/``up`` as in ``lora_gate_up`` and ``w1``/``w3`` the two halves of
    ``w13``; the base is one grouped GEMM (and one in the backward), the adapters are added into the output's
    halves in place.

    Args:
        x: ``[rows, Lt]`` sorted by expert. A: ``[2r, Lt]`` = ``[w1_lora_A; w3_lora_A]``.
        B1, B3: ``[E, F, r]``. w13: ``[E, 2F, Lt]`` (frozen; gate rows first). counts: ``[E]`` (moved to x's
            device). scale: ``alpha / r``.

    Returns:
        ``[rows, 2F]`` in x's dtype.
    """
    counts = counts.to(x.device)
    if A.dim() != 2 or B1.dim() != 3 or B1.shape != B3.shape or A.shape != (2 * B1.shape[2], x.shape[1]) \
            or w13.dim() != 3 or tuple(w13.shape) != (B1.shape[0], 2 * B1.shape[1], x.shape[1]):
        raise ValueError(f"lora_fc1: A {tuple(A.shape)}, B1 {tuple(B1.shape)}, B3 {tuple(B3.shape)}, w13 "
                         f"{tuple(w13.shape)} for x {tuple(x.shape)}: expected A [2r, Lt], B1 and B3 [E, F, r], "
                         "w13 [E, 2F, Lt]")
    _check_module_inputs("lora_fc1", x, counts, x=x, A=A, B1=B1, B3=B3, w13=w13)
    return _GateUpLoRA.apply(x, A, B1, B3, w13, None, counts, float(scale))


def lora_down(h: torch.Tensor, A2: torch.Tensor, B2: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Down projection of expert-sorted rows with per-expert-A, shared-B LoRA, the rank-r parts on the kernels.

    ``out = grouped(h, w2) + s · grouped(h, A2) B2ᵀ``, as ``LoRALatentExperts.down``'s plain path; gradients for
    h, A2 and B2, none for the frozen w2.

    Args:
        h: ``[rows, F]`` sorted by expert. A2: ``[E, r, F]``. B2: ``[Lt, r]`` (shared). w2: ``[E, Lt, F]``
            (frozen). counts: ``[E]`` (moved to h's device). scale: ``alpha / r``.

    Returns:
        ``[rows, Lt]`` in h's dtype.
    """
    counts = counts.to(h.device)
    if A2.dim() != 3 or B2.dim() != 2 or A2.shape[2] != h.shape[1] or B2.shape[1] != A2.shape[1]:
        raise ValueError(f"lora_down: A2 {tuple(A2.shape)}, B2 {tuple(B2.shape)} for h {tuple(h.shape)}: expected "
                         "A2 [E, r, F], B2 [Lt, r]")
    _check_module_inputs("lora_down", h, counts, h=h, A2=A2, B2=B2, w2=w2)
    return _DownLoRA.apply(h, A2, B2, w2, counts, float(scale))
