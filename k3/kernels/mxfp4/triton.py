"""MXFP4 -> BF16 decode on the GPU: a Triton kernel, a plain-torch fallback with the same arithmetic, a dispatch.

Input layout as ``k3.kernels.mxfp4.codec`` (the CPU codec and the reference): ``weight_packed [..., in/2]`` uint8,
low nibble = even column; ``weight_scale [..., ceil(in/32)]`` uint8 E8M0 (``2^(e - 127)``). The output
``[..., in]`` BF16 is bit-identical to the CPU codec's.

How a code becomes BF16 bits without a float multiply (so no flush-to-zero or rounding mode can change a bit):
a magnitude index ``m = code & 7`` is ``0`` or ``(1 + f/2) · 2^o`` with

    m    1    2    3    4    5    6    7
    o   -1    0    0    1    1    2    2        o = m // 2 - 1  (m ≥ 2),  -1 for m = 1
    f    0    0    1    0    1    0    1        f = m & 1       (m ≥ 2),   0 for m = 1

so the value ``(1 + f/2) · 2^(o + e - 127)`` has the biased BF16 exponent ``b = e + o``. For ``b ≥ 1`` it is a
normal number, bits ``b << 7 | f << 6``. ``b`` can only be 0 or -1 below that (``e ≥ 0``, ``o ≥ -1``): a
subnormal ``mantissa · 2^-133`` with ``mantissa = (2 + f) · 2^(b + 5)``, i.e. ``(2 + f) · 32`` or ``· 16``. The
sign is bit 15 (code 8 is -0). Scale bytes above ``E8M0_MAX_FINITE_BF16`` (252; 255 is NaN) are rejected
before decoding, as on the CPU, with the CPU codec's message.

Subnormals need ``e ≤ 1`` (scales of 2^-126 and below, which no trained weight has). One ``aminmax`` over the
scales (1/16 of the packed bytes; the same pass checks the upper bound) picks the kernel: with every ``e ≥ 2``
each nonzero code is a normal number and its bits are just ``e · 128 + T(m)``, ``T(m) = (m - 2) · 64`` for
``m ≥ 2`` and ``-128`` for ``m = 1`` (half the integer work of the general form, which the other variant runs).

Rows of a multiple of 16 bytes (``in`` a multiple of 32: every real weight) run a flat kernel over consecutive
bytes (scale of byte ``i`` = ``i // 16``); other rows a 2-D tiled one. Each packed byte becomes one 32-bit word
holding its two BF16 values (low column in the low half), written into the output viewed as int32; the word is
assembled as ``lo + hi · 65536`` with ``lo`` the unsigned and ``hi`` the signed 16-bit pattern, so no step
overflows int32.

Checked without a GPU: both kernels and both forms are bit-exact against the CPU codec under
``TRITON_INTERPRET=1`` (every byte × every finite scale, random 2-D/3-D shapes, several tiles), and compile for
sm_90 with Triton 3.6 (16-byte vector loads and stores in the flat kernel).
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch

# The codec's own checks, so every device raises the same messages.
from k3.kernels.mxfp4.codec import E8M0_MAX_FINITE_BF16, MXFP4Error, check_scale, check_shapes
from k3.kernels.mxfp4.codec import decode_mxfp4 as decode_mxfp4_cpu

__all__ = ["DEFAULT_BLOCK_BYTES", "DEFAULT_BLOCK_ROWS", "Impl", "TorchPairDecoder", "decode_mxfp4",
           "decode_mxfp4_torch", "triton_available"]

Impl = Literal["auto", "triton", "torch", "cpu"]

# One program decodes a [16 rows, 256 packed bytes] tile: 4 KiB in, 16 KiB out, 16 scales per row.
DEFAULT_BLOCK_ROWS = 4  # the fastest tile of bench/gpu_mxfp4.py on the H200 (76% of D2D copy; 16 rows: 67%)
DEFAULT_BLOCK_BYTES = 256
DEFAULT_NUM_WARPS = 4
_PACKED_PER_SCALE = 16  # packed bytes per E8M0 scale (32 columns)
_TORCH_CHUNK_BYTES = 1 << 24  # packed bytes per step of the torch fallback (bounds its int32 temporaries)
_MIN_NORMAL_SCALE_BYTE = 2  # from here up, code 1 (0.5 · 2^(e-127)) is a normal BF16, and so is every code


# ------------------------------------------------------------------------------------------------ Triton
try:  # the kernels are module-level: Triton resolves the helper by its global name
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - ImportError, or a broken Triton install: the torch fallback serves
    triton = None

if triton is not None:

    @triton.jit
    def _e2m1_magnitude_bits(code, e):
        # General form. code: int32 (low 3 bits used), e: int32 scale byte in [0, 252] -> BF16 bits, no sign
        m = code & 7
        o = tl.where(m == 1, -1, (m >> 1) - 1)
        f = tl.where(m == 1, 0, m & 1)
        b = e + o
        normal = b * 128 + f * 64
        subnormal = (2 + f) * tl.where(b < 0, 16, 32)
        bits = tl.where(b >= 1, normal, subnormal)
        return tl.where(m == 0, 0, bits)

    @triton.jit
    def _e2m1_normal_bits(code, e128):
        # Every scale byte >= 2, so every nonzero code is a normal BF16; e128 = 128 * scale byte
        m = code & 7
        return tl.where(m == 0, 0, e128 + tl.where(m == 1, -128, m * 64 - 128))

    @triton.jit
    def _mxfp4_decode_kernel(packed_ptr, scale_ptr, out_ptr, rows, n_bytes, n_scales,
                             BLOCK_ROWS: tl.constexpr, BLOCK_BYTES: tl.constexpr, PER_SCALE: tl.constexpr,
                             SUBNORMAL: tl.constexpr):
        # Rows on grid axis 0 (up to 2^31 - 1 programs); byte columns on axis 1. Row offsets in int64: a stacked
        # expert weight is more than 2^31 bytes.
        r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        c = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
        mask = (r[:, None] < rows) & (c[None, :] < n_bytes)
        byte = tl.load(packed_ptr + r[:, None] * n_bytes + c[None, :], mask=mask, other=0).to(tl.int32)
        e = tl.load(scale_ptr + r[:, None] * n_scales + (c // PER_SCALE)[None, :], mask=mask, other=0).to(tl.int32)
        if SUBNORMAL:
            lo = _e2m1_magnitude_bits(byte, e)
            hi = _e2m1_magnitude_bits(byte >> 4, e)
        else:
            e128 = e * 128
            lo = _e2m1_normal_bits(byte, e128)
            hi = _e2m1_normal_bits(byte >> 4, e128)
        lo = lo + (byte & 8) * 4096  # the unsigned 16-bit pattern: sign at bit 15
        hi = hi - ((byte >> 7) & 1) * 32768  # the signed 16-bit value
        tl.store(out_ptr + r[:, None] * n_bytes + c[None, :], lo + hi * 65536, mask=mask)

    @triton.jit
    def _mxfp4_decode_flat_kernel(packed_ptr, scale_ptr, out_ptr, total, BLOCK: tl.constexpr,
                                  PER_SCALE: tl.constexpr, SUBNORMAL: tl.constexpr):
        # Rows of a multiple of 16 bytes (every real shape): the flattened bytes fall in groups of 16 sharing one
        # scale, so a program takes BLOCK consecutive bytes as [BLOCK / 16 groups, 16] and loads one scale per
        # group; 64-bit offsets only in its three base pointers.
        start = tl.program_id(0).to(tl.int64) * BLOCK
        packed_ptr += start
        out_ptr += start
        scale_ptr += start // PER_SCALE
        g = tl.arange(0, BLOCK // PER_SCALE)
        offs = g[:, None] * PER_SCALE + tl.arange(0, PER_SCALE)[None, :]
        live = g < tl.minimum((total - start) // PER_SCALE, BLOCK // PER_SCALE).to(tl.int32)
        byte = tl.load(packed_ptr + offs, mask=live[:, None], other=0).to(tl.int32)
        e = tl.load(scale_ptr + g, mask=live, other=0).to(tl.int32)[:, None]
        if SUBNORMAL:
            lo = _e2m1_magnitude_bits(byte, e)
            hi = _e2m1_magnitude_bits(byte >> 4, e)
        else:
            e128 = e * 128
            lo = _e2m1_normal_bits(byte, e128)
            hi = _e2m1_normal_bits(byte >> 4, e128)
        lo = lo + (byte & 8) * 4096
        hi = hi - ((byte >> 7) & 1) * 32768
        tl.store(out_ptr + offs, lo + hi * 65536, mask=live[:, None])


def triton_available() -> bool:
    """True when the Triton kernel exists (running it also needs a CUDA device, or ``TRITON_INTERPRET=1``)."""
    return triton is not None


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_triton(packed: torch.Tensor, scale: torch.Tensor, words: torch.Tensor, subnormal: bool,
                   block_rows: int, block_bytes: int, num_warps: int) -> None:
    """Decode ``packed [rows, n_bytes]`` with ``scale [rows, n_scales]`` into ``words [rows, n_bytes]`` int32."""
    if triton is None:
        raise RuntimeError("decode_mxfp4: impl='triton' needs Triton (pip install triton) and a CUDA device")
    for name, v in (("block_rows", block_rows), ("block_bytes", block_bytes), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"decode_mxfp4: {name}={v}: expected a power of two")
    if block_rows * block_bytes < _PACKED_PER_SCALE:
        raise ValueError(f"decode_mxfp4: block_rows * block_bytes = {block_rows * block_bytes}: expected at least "
                         f"{_PACKED_PER_SCALE} (one scale group)")
    rows, n_bytes = packed.shape
    if n_bytes % _PACKED_PER_SCALE == 0:  # the flat kernel: one tile of block_rows * block_bytes bytes
        block = block_rows * block_bytes
        _mxfp4_decode_flat_kernel[(triton.cdiv(rows * n_bytes, block),)](
            packed, scale, words, rows * n_bytes, BLOCK=block, PER_SCALE=_PACKED_PER_SCALE, SUBNORMAL=subnormal,
            num_warps=num_warps)
        return
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(n_bytes, block_bytes))
    if grid[1] > 65535:
        raise MXFP4Error(f"weight_packed rows of {n_bytes} bytes exceed the kernel's grid "
                         f"({65535 * block_bytes} bytes per row at most)")
    _mxfp4_decode_kernel[grid](packed, scale, words, rows, n_bytes, scale.shape[1], BLOCK_ROWS=block_rows,
                                BLOCK_BYTES=block_bytes, PER_SCALE=_PACKED_PER_SCALE, SUBNORMAL=subnormal,
                                num_warps=num_warps)


# ------------------------------------------------------------------------------------------------ torch
def _magnitude_bits_torch(code: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """The kernel's ``_e2m1_magnitude_bits`` (general form) in torch ops (int32 in, int32 out)."""
    m = code & 7
    one = m == 1
    o = torch.where(one, -1, (m >> 1) - 1)
    f = torch.where(one, 0, m & 1)
    b = e + o
    normal = b * 128 + f * 64
    subnormal = (2 + f) * torch.where(b < 0, 16, 32)
    bits = torch.where(b >= 1, normal, subnormal)
    return torch.where(m == 0, 0, bits)


def _normal_bits_torch(code: torch.Tensor, e128: torch.Tensor) -> torch.Tensor:
    """The kernel's ``_e2m1_normal_bits`` (every scale byte >= 2) in torch ops."""
    m = code & 7
    return torch.where(m == 0, 0, e128 + torch.where(m == 1, -128, m * 64 - 128))


def _decode_words_torch(packed: torch.Tensor, scale: torch.Tensor, words: torch.Tensor, subnormal: bool) -> None:
    """Same contract as ``_launch_triton``, in chunks of rows so the int32 temporaries stay bounded."""
    rows, n_bytes = packed.shape
    col_scale = torch.arange(n_bytes, device=packed.device) // _PACKED_PER_SCALE
    step = max(1, _TORCH_CHUNK_BYTES // max(n_bytes, 1))
    for r in range(0, rows, step):
        byte = packed[r:r + step].int()
        e = scale[r:r + step].int()[:, col_scale]
        if subnormal:
            lo, hi = _magnitude_bits_torch(byte, e), _magnitude_bits_torch(byte >> 4, e)
        else:
            lo, hi = _normal_bits_torch(byte, e * 128), _normal_bits_torch(byte >> 4, e * 128)
        lo = lo + (byte & 8) * 4096
        hi = hi - ((byte >> 7) & 1) * 32768
        words[r:r + step] = lo + hi * 65536


def decode_mxfp4_torch(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The plain-torch decoder on the inputs' device (the GPU fallback without Triton); see ``decode_mxfp4``."""
    return decode_mxfp4(packed, scale, impl="torch")


# ------------------------------------------------------------------------------------------------ dispatch
def _check_inputs(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if not isinstance(packed, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise MXFP4Error(f"weight_packed / weight_scale must be torch tensors, got {type(packed).__name__} / "
                         f"{type(scale).__name__}")
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MXFP4Error(f"weight_packed / weight_scale must be uint8, got {packed.dtype} / {scale.dtype}")
    check_shapes(tuple(packed.shape), tuple(scale.shape))


def _scale_range_checked(scale: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` scale byte in one pass on the device (one sync); a bad tensor is copied to the host only to
    raise the codec's message."""
    lo, hi = torch.stack(torch.aminmax(scale)).tolist()
    if hi > E8M0_MAX_FINITE_BF16:
        check_scale(scale.cpu().numpy())
    return lo, hi


def _resolve_device(device: torch.device | str | None, packed: torch.Tensor) -> torch.device:
    dev = packed.device if device is None else torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"decode_mxfp4: device={str(dev)!r} but no CUDA device is available "
                               "(torch.cuda.is_available() is False); decode on device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"decode_mxfp4: device={str(dev)!r}: expected cpu or cuda")
    return dev


def _resolve_impl(impl: Impl, dev: torch.device) -> Impl:
    if impl == "auto":
        if dev.type == "cpu":
            return "cpu"
        return "triton" if triton_available() else "torch"
    if impl not in ("triton", "torch", "cpu"):
        raise ValueError(f"decode_mxfp4: impl={impl!r}: expected auto, triton, torch or cpu")
    if impl == "cpu" and dev.type != "cpu":
        raise ValueError(f"decode_mxfp4: impl='cpu' decodes on the CPU, not on {dev}")
    if impl == "triton" and dev.type == "cpu" and not _triton_interpreting():
        raise ValueError("decode_mxfp4: impl='triton' runs on a CUDA device (or on the CPU under TRITON_INTERPRET=1)")
    return impl


def decode_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    device: torch.device | str | None = None,
    impl: Impl = "auto",
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """Dequantize MXFP4 to BF16 on ``device``, bit-identical to the CPU codec.

    Args:
        packed: ``[..., in/2]`` uint8 (any device; moved to ``device``).
        scale: ``[..., ceil(in/32)]`` uint8 E8M0, same leading dims.
        device: where to decode and return (default: ``packed``'s device). ``cuda`` without a CUDA device is a
            RuntimeError.
        impl: ``auto`` (CPU codec on the CPU; Triton on CUDA when importable, else the torch fallback),
            ``triton``, ``torch`` (any device) or ``cpu`` (the codec in ``k3.kernels.mxfp4.codec``).
        block_rows, block_bytes, num_warps: the Triton tile (powers of two; benchmarks try others).

    Returns:
        ``[..., in]`` BF16 on ``device``.

    Raises:
        MXFP4Error: wrong dtypes or shapes, or a scale byte that is NaN (255) or overflows BF16 (>= 253), with the
            CPU codec's message.
    """
    _check_inputs(packed, scale)
    dev = _resolve_device(device, packed)
    impl = _resolve_impl(impl, dev)
    if impl == "cpu":
        return decode_mxfp4_cpu(packed.cpu(), scale.cpu())
    lead, n_bytes = tuple(packed.shape[:-1]), packed.shape[-1]
    out = torch.empty(*lead, 2 * n_bytes, dtype=torch.bfloat16, device=dev)
    if out.numel() == 0:
        return out
    packed = packed.to(dev, non_blocking=True).contiguous().reshape(-1, n_bytes)
    scale = scale.to(dev, non_blocking=True).contiguous().reshape(packed.shape[0], scale.shape[-1])
    lowest, _ = _scale_range_checked(scale)
    subnormal = lowest < _MIN_NORMAL_SCALE_BYTE
    words = out.view(torch.int32).view(-1, n_bytes)  # one int32 per packed byte: its two BF16 values
    if impl == "triton":
        _launch_triton(packed, scale, words, subnormal, block_rows, block_bytes, num_warps)
    else:
        _decode_words_torch(packed, scale, words, subnormal)
    return out


class TorchPairDecoder:
    """``k3.kernels.mxfp4.codec.PairDecoder``'s contract on a torch device: the converter's ``--device cuda``.

    ``decode(packed [rows, in/2], scale [rows, ceil(in/32)])`` (uint8 numpy arrays) returns ``[rows, in/2]``
    uint32 numpy, each word the BF16 bits of columns ``2j`` (low half) and ``2j+1``; a view of a reused host
    buffer (pinned on CUDA), valid until the next call. Raises MXFP4Error exactly as the CPU decoder does.
    """

    def __init__(self, device: torch.device | str = "cuda", impl: Impl = "auto") -> None:
        self.device = _resolve_device(device, torch.empty(0))
        self.impl = impl
        self._host = torch.empty(0, dtype=torch.int32)

    def decode(self, packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
        if packed.dtype != np.uint8 or scale.dtype != np.uint8:
            raise MXFP4Error(f"weight_packed / weight_scale must be uint8, got {packed.dtype} / {scale.dtype}")
        check_shapes(packed.shape, scale.shape)
        rows, n_bytes = packed.shape[0], packed.shape[-1]
        p = torch.from_numpy(np.ascontiguousarray(packed).reshape(rows, n_bytes))
        s = torch.from_numpy(np.ascontiguousarray(scale).reshape(rows, -1))
        words = decode_mxfp4(p, s, device=self.device, impl=self.impl).view(torch.int32).view(rows, n_bytes)
        n = words.numel()
        if self._host.numel() < n:
            self._host = torch.empty(n, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = self._host[:n].view(rows, n_bytes)
        host.copy_(words)  # synchronous: the caller writes the bytes next
        return host.numpy().view(np.uint32)
