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
``expand_add_(dh, dha, A.transpose(1, 2))``. Their plain-torch references are in ``reference.py``; the autograd
functions built on them (``lora_gate_up``, ``lora_fc1``, ``lora_down``) in ``function.py``.

Why kernels: torch's grouped GEMM runs these shapes far from bandwidth on the H200 (``[rows, 32] x [E, 32, 3072]``
at 11 TFLOP/s, 0.28 ms, for ~0.05 ms of memory traffic; docs/PERFORMANCE.md). All three are memory-bound: one
pass over the wide operand, the rank-r operand and the per-expert factor staying in L2. The floor they aim at, by
bytes moved at K3's EP8 shapes (16,352 rows, latent 3584, width 3072, r 32, bf16): ~0.85 GB for the adapter's
forward and ~1.2 GB for its backward, ~0.5 ms at the H200's measured 4.3 TB/s copy rate against the base's
8.6 ms forward+backward, i.e. ~6%. Measured on the H200 (``bench/gpu_lora_kernels.py``, CUDA-graph replays): each
kernel moves its bytes at 65-82% of a D2D copy's rate (two runs); the module's forward+backward is +8.2-9.2% over
the frozen experts' when calls run back to back, +10.2-10.4% timed from an idle device (3 runs; docs/PERFORMANCE.md).

Tiling. ``expand_add_`` and ``contract`` take their row tiles (``BLOCK_M`` rows of one expert) from the schedule of
``schedule.py``, built on the device from ``counts``; the grid is its upper bound ``cdiv(rows, BLOCK_M) + E`` and
tiles past the last real one exit at once. ``expand_add_`` runs one program per (row tile, ``BLOCK_N`` columns),
the columns fastest so the programs running together share one ``B_e`` and one ``xa`` tile in L2; ``contract`` one
program per row tile, looping over K in ``BLOCK_K`` steps. ``weight_grad`` runs one program per (expert,
``[BLOCK_P, BLOCK_Q]`` output block), looping over the expert's rows (from the device offsets; an expert without
rows writes zeros). The rank-r dimension is one block padded to a power of two >= 16 (``tl.dot``'s minimum), masked.

Every kernel takes a *pair* of calls of one shape and strides in one launch (grid axis 1; the second call's tensors
as element offsets from the first's): gate and up run together, so a forward+backward launches 7 kernels, not 11.

Numerics: fp32 accumulation; bf16 (or fp16) in and out on CUDA with bf16 tensor-core products; fp32 in and out
with IEEE fp32 products (no TF32), so fp32 results equal a float32 reference up to summation order.

Runs on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (``availability.py``: set before this module is
imported). Triton 3.6's interpreter multiplies bf16 ``tl.dot`` operands as their raw uint16 bit patterns (numpy has
no bf16), so under the interpreter the kernels upcast them to fp32 first.

The default tiles are the swept ones' near-best (``bench/gpu_lora_kernels.py`` sweeps them: within 10% of the best
per kernel on the H200, and the module's time did not move with the tuned ones).
"""

from __future__ import annotations

import torch

from k3.kernels import availability
from k3.kernels.expert_lora.schedule import checked_schedule, row_offsets

__all__ = ["DEFAULT_BLOCKS", "MAX_RANK", "Pair", "check_counts", "check_dtypes", "contract", "cpu_interpreter_problem",
           "expand_add_", "require_triton", "weight_grad"]

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


def cpu_interpreter_problem() -> str | None:
    """Why the kernels cannot run on the CPU here (for a test's skip reason), or None: it runs the smallest call."""
    if not availability.triton_available():
        return "Triton is not importable (CI's venv has none); run under TRITON_INTERPRET=1 in a venv with Triton"
    if not availability.INTERPRETING:
        return "TRITON_INTERPRET=1 is not set: the kernels run on the CPU only under Triton's interpreter"
    try:  # Triton 3.6's interpreter breaks on numpy >= 2.4 (triton-lang/triton#9171)
        contract(torch.ones(1, 16), torch.ones(1, 2, 16), torch.tensor([1]))
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"Triton's interpreter fails here ({type(e).__name__}: {str(e)[:120]}; numpy < 2.4 needed for 3.6)"
    return None


# ------------------------------------------------------------------------------------------------ checks
def require_triton(name: str, *tensors: torch.Tensor) -> None:
    """A RuntimeError where Triton is missing, a ValueError naming ``name`` where the tensors are on several devices
    or on one the kernels cannot run on (``availability.triton_runs_on``)."""
    if availability.triton is None:
        raise RuntimeError(f"{name}: needs Triton (pip install triton) and a CUDA device; without them use the "
                           "torch path (LoRALatentExperts(lora_impl='torch'))")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"{name}: tensors on {sorted({str(t.device) for t in tensors})}: expected one device")
    if not availability.triton_runs_on(device):
        where = ("a CUDA device (or on the CPU under TRITON_INTERPRET=1, set before k3.kernels.expert_lora is "
                 "imported)")
        raise ValueError(f"{name}: the Triton kernels run on {where}, not on {device}"
                         + (" while TRITON_INTERPRET=1" if availability.INTERPRETING else ""))


def check_dtypes(name: str, **tensors: torch.Tensor) -> torch.dtype:
    """The one dtype of ``tensors`` (float32, bfloat16 or float16), else a ValueError naming ``name``."""
    dtypes = {n: t.dtype for n, t in tensors.items()}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"{name}: dtypes {dtypes}: expected one dtype")
    dtype = next(iter(dtypes.values()))
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: dtype {dtype}: expected float32, bfloat16 or float16")
    return dtype


def check_counts(name: str, counts: torch.Tensor, experts: int, rows: int) -> None:
    """A ValueError naming ``name`` unless ``counts`` is ``[experts]`` integer, ``experts >= 1``, and (on the CPU,
    where it costs no device sync) non-negative and summing to ``rows``."""
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
    return {"IEEE": dtype == torch.float32, "UPCAST": availability.INTERPRETING and dtype != torch.float32}


def _pow2_block(n: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(n))


def _blocks(kernel: str, **given: int | None) -> list[int]:
    """The given tile sizes, ``DEFAULT_BLOCKS[kernel]``'s where None (read per call: the bench sweeps them)."""
    return [DEFAULT_BLOCKS[kernel][k] if v is None else v for k, v in given.items()]


def _check_block(name: str, **blocks: int) -> None:
    for key, v in blocks.items():
        if v < _MIN_DOT or v & (v - 1):
            raise ValueError(f"{name}: {key}={v}: expected a power of two >= {_MIN_DOT}")


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
    dtype = check_dtypes(name, out=out, xa=xa, B=B)
    _check_rank(name, xa.shape[1])
    check_counts(name, counts, B.shape[0], out.shape[0])
    require_triton(name, out, xa, B, counts)
    block_m, block_n, num_warps, num_stages = _blocks("expand", block_m=block_m, block_n=block_n,
                                                      num_warps=num_warps, num_stages=num_stages)
    _check_block(name, block_m=block_m, block_n=block_n)
    rows, N = out.shape
    if rows == 0 or N == 0:
        return given
    schedule = checked_schedule(name, schedule, counts, rows, block_m)
    n_tiles = schedule.shape[1]
    grid = (n_tiles * triton.cdiv(N, block_n), calls)
    _expand_add_kernel[grid](out, xa, B, *pair_offsets, schedule, n_tiles, N, xa.shape[1], *out.stride(),
                             *xa.stride(), *B.stride(), BLOCK_M=block_m, BLOCK_N=block_n,
                             BLOCK_R=_pow2_block(xa.shape[1]), **_flags(dtype), num_warps=num_warps,
                             num_stages=num_stages)
    return given


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
    dtype = check_dtypes(name, h=h, A=A, out=out)
    _check_rank(name, r)
    check_counts(name, counts, A.shape[0], rows)
    require_triton(name, h, A, out, counts)
    block_m, block_k, num_warps, num_stages = _blocks("contract", block_m=block_m, block_k=block_k,
                                                      num_warps=num_warps, num_stages=num_stages)
    _check_block(name, block_m=block_m, block_k=block_k)
    if rows == 0:
        return given
    if K == 0:
        for o in (given if calls == 2 else (given,)):
            o.zero_()
        return given
    schedule = checked_schedule(name, schedule, counts, rows, block_m)
    n_tiles = schedule.shape[1]
    _contract_kernel[(n_tiles, calls)](h, A, out, *pair_offsets, schedule, n_tiles, K, r, float(scale), *h.stride(),
                                       *A.stride(), *out.stride(), BLOCK_M=block_m, BLOCK_K=block_k,
                                       BLOCK_R=_pow2_block(r), **_flags(dtype), num_warps=num_warps,
                                       num_stages=num_stages)
    return given


def _shape(t: torch.Tensor | Pair) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else [tuple(x.shape) for x in t]


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
    dtype = check_dtypes(name, a=a, b=b)
    rows, P = a.shape
    Q = b.shape[1]
    E = counts.shape[0] if counts.dim() == 1 else -1
    check_counts(name, counts, E, rows)
    require_triton(name, a, b, counts)
    block_m, block_wide, num_warps, num_stages = _blocks("weight_grad", block_m=block_m, block_wide=block_wide,
                                                         num_warps=num_warps, num_stages=num_stages)
    _check_block(name, block_m=block_m, block_wide=block_wide)
    both = a.new_empty(calls, E, P, Q)  # one allocation: the pair's outputs sit E·P·Q elements apart
    outs = tuple(both.unbind(0))
    if both.numel() == 0:
        return outs if calls == 2 else outs[0]
    if offsets is None:
        offsets = row_offsets(counts)
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
