"""MXFP4 codec for compressed-tensors ``mxfp4-pack-quantized`` weights (the released routed experts).

Layout, for a logical weight ``W [out, in]``:

- ``weight_packed [out, in/2]`` uint8: two E2M1 codes per byte, the **low nibble holds the even column** and the
  high nibble the odd one. A code is ``sign (bit 3) | magnitude index (bits 0-2)`` into
  ``(0, 0.5, 1, 1.5, 2, 3, 4, 6)``; code 8 is -0.
- ``weight_scale [out, ceil(in/32)]`` uint8: one E8M0 byte per 32 consecutive input columns, value
  ``2^(e - 127)``; byte 255 is NaN in E8M0 and is rejected.

Decode is exact: every E2M1 value times a power of two is representable in BF16 (including the subnormal scales
``e < 1``), except for scale bytes >= 253, where the large codes overflow BF16; those are rejected too.

Encode follows the OCP Microscaling spec v1.0: per block of 32, the shared exponent is
``floor(log2(amax)) - 2`` (2 = emax of E2M1), clamped to the E8M0 range; elements are ``v / 2^shared`` rounded to
the nearest E2M1 value, ties to even, saturating at +-6.

compressed-tensors 0.20 (``generate_mx_scales``) picks the same exponent except when the block's amax has a
mantissa in ``[1.75, 2)``: it rounds amax up to the next power of two first, so its exponent is one higher there
(the block max then lands on 3.5..4 -> 4 instead of 7..8 -> saturated 6). Element rounding is identical. The tests
check bit equality with compressed-tensors everywhere outside that band and the exact +1 inside it.

The real shapes are multiples of 32; a last block shorter than 32 is supported (its scale covers the remaining
columns), matching compressed-tensors' ``ceil(in / group_size)`` scale shape.

The codec is numpy at heart (``PairDecoder`` works on raw file bytes); ``decode_mxfp4`` / ``encode_mxfp4`` wrap it
for torch tensors and import torch when called, so the converter's worker processes never load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "E8M0_BIAS",
    "E8M0_NAN",
    "E8M0_MAX_FINITE_BF16",
    "MXFP4Error",
    "check_scale",
    "check_shapes",
    "decode_mxfp4",
    "decode_mxfp4_pairs",
    "PairDecoder",
    "encode_mxfp4",
    "packed_shapes",
]

BLOCK_SIZE = 32  # input columns per E8M0 scale (the MX block)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_EMAX = 2  # exponent of E2M1's largest binade: 6 = 1.5 * 2^2
E2M1_MAX = 6.0
# The largest scale byte whose every code decodes to a finite BF16 (6 * 2^125 < 2^128; 4 * 2^126 = 2^128 is inf).
E8M0_MAX_FINITE_BF16 = 252

# code -> value; codes 8..15 are the negatives of 0..7 (8 is -0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)

# Round-to-nearest-even decision points between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6. A tie goes to
# the even code (0, 2, 4, 6): strictly above .25, 1.25, 2.5, 5 to round up, at-or-above .75, 1.75, 3.5. The
# "at-or-above" points are stored one float32 ulp lower so one strict comparison serves all seven.
_ROUND_UP_ABOVE = np.array(
    [0.25, np.nextafter(np.float32(0.75), np.float32(0)), 1.25, np.nextafter(np.float32(1.75), np.float32(0)), 2.5,
     np.nextafter(np.float32(3.5), np.float32(0)), 5.0],
    dtype=np.float32,
)


class MXFP4Error(ValueError):
    """A packed weight, scale or input is not valid MXFP4 (the message says which element)."""


def packed_shapes(out_features: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(weight_packed shape, weight_scale shape)`` of a logical ``[out, in]`` weight."""
    if in_features % 2:
        raise MXFP4Error(f"in_features={in_features}: MXFP4 packs two columns per byte, so it must be even")
    return (out_features, in_features // 2), (out_features, -(-in_features // BLOCK_SIZE))


def _pair_table() -> np.ndarray:
    """``[256 * 256]`` uint32: entry ``scale << 8 | byte`` holds the byte's two decoded BF16 values, low column in
    the low half-word, so a gather writes the BF16 output directly with no multiply."""
    byte = np.arange(256)
    pair = np.stack([E2M1_VALUES[byte & 0xF], E2M1_VALUES[byte >> 4]], axis=-1)  # [256 bytes, 2]
    with np.errstate(over="ignore", invalid="ignore"):  # rows >= 253 overflow; they are rejected before use
        scale = np.ldexp(np.float32(1), np.arange(256) - E8M0_BIAS).astype(np.float32)  # 2^-127 is subnormal
        values = scale[:, None, None] * pair[None]  # exact in float32
    # BF16 is the top half of a float32; every finite value here has at most 2 significant bits, so the
    # truncation is exact.
    bf16 = values.view(np.uint32) >> 16
    bf16[E8M0_NAN] = 0x7FC0  # NaN
    return (bf16[..., 0] | (bf16[..., 1] << 16)).reshape(-1).astype(np.uint32)


_PAIR_TABLE: np.ndarray | None = None  # built on first use (256 KiB)


def _table() -> np.ndarray:
    global _PAIR_TABLE
    if _PAIR_TABLE is None:
        _PAIR_TABLE = _pair_table()
    return _PAIR_TABLE


def check_shapes(packed_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    """MXFP4Error unless ``weight_packed`` of ``packed_shape`` ``[..., in/2]`` and ``weight_scale`` of
    ``scale_shape`` ``[..., ceil(in/32)]`` belong together (every decoder checks this, so each raises the same
    message)."""
    if len(packed_shape) < 1 or tuple(packed_shape[:-1]) != tuple(scale_shape[:-1]):
        raise MXFP4Error(
            f"weight_packed {list(packed_shape)} and weight_scale {list(scale_shape)}: leading dims differ"
        )
    in_features = 2 * packed_shape[-1]
    expected = packed_shapes(1, in_features)[1][1]
    if scale_shape[-1] != expected:
        raise MXFP4Error(
            f"weight_scale {list(scale_shape)} does not match weight_packed {list(packed_shape)}: "
            f"{in_features} input columns need {expected} scales per row (one per {BLOCK_SIZE})"
        )


def check_scale(scale: np.ndarray) -> None:
    """MXFP4Error naming the first scale byte that is NaN (255) or overflows BF16 (>= 253), and how many there are.

    Args:
        scale: uint8 E8M0 scale bytes, any shape (host memory).
    """
    bad = scale > E8M0_MAX_FINITE_BF16
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        byte = int(scale[tuple(idx)])
        what = "NaN in E8M0" if byte == E8M0_NAN else f"2^{byte - E8M0_BIAS}, which overflows BF16 for codes >= 4"
        raise MXFP4Error(f"weight_scale{idx} = {byte} (0x{byte:02X}): {what}; {int(bad.sum())} such bytes")


class PairDecoder:
    """CPU decode on raw arrays into reusable buffers (no allocation per call once warm).

    ``decode(packed [rows, in/2], scale [rows, ceil(in/32)])`` (uint8; read-only views of a file are fine) returns
    ``[rows, in/2]`` uint32, each holding the BF16 bits of columns ``2j`` (low half) and ``2j+1`` (high half), i.e.
    the little-endian BF16 bytes of the ``[rows, in]`` result. The array is a view of the decoder's buffer, valid
    until the next call. Reuse matters when streaming: fresh multi-MB allocations page-fault, and under heavy
    page-cache writeback those faults cost several times the decode itself.
    """

    def __init__(self) -> None:
        self._index = np.empty(0, dtype=np.intp)
        self._out = np.empty(0, dtype=np.uint32)

    def decode(self, packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
        if packed.dtype != np.uint8 or scale.dtype != np.uint8:
            raise MXFP4Error(f"weight_packed / weight_scale must be uint8, got {packed.dtype} / {scale.dtype}")
        check_shapes(packed.shape, scale.shape)
        check_scale(scale)
        n_bytes = packed.shape[-1]
        p = packed.reshape(-1, n_bytes)
        rows = p.shape[0]
        s = scale.reshape(rows, -1)
        half = BLOCK_SIZE // 2  # packed bytes per block
        pad = -n_bytes % half
        if pad:  # a short last block: pad with zero codes, slice after
            p = np.pad(p, ((0, 0), (0, pad)))
        n = p.size
        if self._index.size < n:
            self._index = np.empty(n, dtype=np.intp)
            self._out = np.empty(n, dtype=np.uint32)
        # One gather per output pair: index = scale byte << 8 | packed byte into the 64K-entry table.
        idx = self._index[:n].reshape(rows, -1, half)
        np.add((s.astype(np.intp) << 8)[:, :, None], p.reshape(rows, -1, half), out=idx)  # one pass over n
        out = self._out[:n]
        np.take(_table(), idx.reshape(-1), out=out)
        pairs = out.reshape(rows, -1)
        return np.ascontiguousarray(pairs[:, :n_bytes]) if pad else pairs


def decode_mxfp4_pairs(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``PairDecoder().decode(packed, scale)`` into fresh arrays: see ``PairDecoder``. Same checks as
    ``decode_mxfp4``."""
    return PairDecoder().decode(packed, scale)


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize ``packed [..., in/2]`` uint8 with ``scale [..., ceil(in/32)]`` uint8 to ``[..., in]`` in
    ``dtype`` (default BF16).

    Exact in BF16 and wider float dtypes. Raises MXFP4Error for wrong dtypes or shapes, and for scale bytes that
    are NaN (255) or overflow BF16 (>= 253).

    Tensors off the CPU take the same table gather in torch ops on their device: the naive form, ~2% of a D2D
    copy's speed on the H200 (docs/PERFORMANCE.md). It stays only as the reference ``bench/gpu_mxfp4.py`` measures
    the GPU decoder against; decode on a GPU with ``k3.kernels.mxfp4.triton.decode_mxfp4``.
    """
    import torch

    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MXFP4Error(f"weight_packed / weight_scale must be uint8, got {packed.dtype} / {scale.dtype}")
    check_shapes(tuple(packed.shape), tuple(scale.shape))
    lead, n_bytes = packed.shape[:-1], packed.shape[-1]
    if packed.device.type == "cpu":
        pairs = torch.from_numpy(decode_mxfp4_pairs(packed.contiguous().numpy(), scale.contiguous().numpy()))
    else:
        check_scale(scale.cpu().numpy())
        pairs = _decode_pairs_torch(packed, scale)
    out = pairs.view(torch.bfloat16).reshape(*lead, 2 * n_bytes)
    return out if dtype in (None, torch.bfloat16) else out.to(dtype)


def _decode_pairs_torch(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Off-CPU: the same table gather with torch ops.
    import torch

    table = torch.from_numpy(_table().view(np.int32)).to(packed.device)
    col_block = torch.arange(packed.shape[-1], device=packed.device) // (BLOCK_SIZE // 2)
    idx = (scale.int()[..., col_block] << 8) | packed.int()
    return table[idx.long()]


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight [..., in]`` (any float dtype; BF16/FP16/FP32 exactly, FP64 via FP32) to
    ``(weight_packed [..., in/2], weight_scale [..., ceil(in/32)])`` uint8 on the CPU, per the OCP MX spec.

    Raises MXFP4Error for an odd ``in``, or for NaN / infinite inputs (they have no MXFP4 encoding).
    """
    import torch

    if not weight.is_floating_point():
        raise MXFP4Error(f"encode_mxfp4 needs a float tensor, got {weight.dtype}")
    in_features = weight.shape[-1]
    packed_shapes(1, in_features)  # validates evenness
    lead = tuple(weight.shape[:-1])
    w = weight.detach().to(device="cpu", dtype=torch.float32).reshape(-1, in_features).numpy()
    pad = -in_features % BLOCK_SIZE
    if pad:
        w = np.pad(w, ((0, 0), (0, pad)))
    blocks = w.reshape(w.shape[0], -1, BLOCK_SIZE)  # [rows, n_blocks, 32]
    magnitude = np.abs(blocks)

    amax = magnitude.max(axis=-1)
    if not np.isfinite(amax).all():  # max propagates NaN and inf
        bad = np.argwhere(~np.isfinite(blocks))[0]
        row, col = int(bad[0]), int(bad[1]) * BLOCK_SIZE + int(bad[2])
        raise MXFP4Error(f"weight row {row} column {col} = {blocks[tuple(bad)]}: MXFP4 cannot encode NaN or inf")
    # frexp: amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly (subnormals included).
    _, exp = np.frexp(amax)
    shared = np.where(amax > 0, exp.astype(np.int32) - 1 - E2M1_EMAX, -E8M0_BIAS)
    shared = np.clip(shared, -E8M0_BIAS, E8M0_BIAS)
    scale = (shared + E8M0_BIAS).astype(np.uint8)

    # |v| / 2^shared is exact (a power-of-two scaling); saturate at 6, then count the rounding points passed.
    scaled = np.minimum(np.ldexp(magnitude, -shared[..., None]), np.float32(E2M1_MAX))
    codes = np.zeros(scaled.shape, dtype=np.uint8)
    for point in _ROUND_UP_ABOVE:
        codes += scaled > point
    codes |= np.signbit(blocks).astype(np.uint8) << 3
    codes = codes.reshape(codes.shape[0], -1)[:, :in_features]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return (
        torch.from_numpy(np.ascontiguousarray(packed)).reshape(*lead, in_features // 2),
        torch.from_numpy(np.ascontiguousarray(scale)).reshape(*lead, -1),
    )
