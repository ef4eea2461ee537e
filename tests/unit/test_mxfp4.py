"""MXFP4 codec: closed forms, a per-element reference encoder, and bit-for-bit agreement with compressed-tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k3.kernels.mxfp4.codec import (
    BLOCK_SIZE,
    E2M1_VALUES,
    MXFP4Error,
    decode_mxfp4,
    decode_mxfp4_pairs,
    encode_mxfp4,
    packed_shapes,
)

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[rows, in/2] -> [rows, in] nibbles, low nibble first (the layout under test, written out plainly)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def reference_encode_element(v: float, shared: int) -> int:
    """Plain OCP element conversion: nearest E2M1 magnitude to |v| / 2^shared, ties to the even code, saturating."""
    x = min(abs(v) / 2.0**shared, 6.0)
    dist = [abs(x - m) for m in MAGNITUDES]
    best = min(dist)
    code = min(i for i, d in enumerate(dist) if d == best and (i % 2 == 0 or dist.count(best) == 1))
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def reference_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-by-element OCP MX encode of a small [rows, in] tensor (float64 arithmetic)."""
    rows, cols = w.shape
    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    n_blocks = -(-cols // BLOCK_SIZE)
    scale = torch.zeros(rows, n_blocks, dtype=torch.uint8)
    for r in range(rows):
        for b in range(n_blocks):
            block = [float(x) for x in w[r, b * BLOCK_SIZE:(b + 1) * BLOCK_SIZE]]
            amax = max(abs(x) for x in block)
            shared = max(-127, min(127, math.floor(math.log2(amax)) - 2)) if amax > 0 else -127
            scale[r, b] = shared + 127
            for j, v in enumerate(block):
                codes[r, b * BLOCK_SIZE + j] = reference_encode_element(v, shared)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


# ------------------------------------------------------------------------------------------------ decode
def test_decode_every_byte_and_every_finite_scale_is_the_closed_form():
    byte = torch.arange(256, dtype=torch.uint8)
    scales = torch.arange(253, dtype=torch.uint8)  # 0..252: every scale whose codes all fit BF16
    packed = byte.repeat(253, 16)  # [253, 4096]: 256 bytes x 16, so every byte sees every scale
    scale = scales.view(-1, 1).expand(253, 256).contiguous()  # one scale byte per 32 columns
    out = decode_mxfp4(packed, scale)
    assert out.shape == (253, 8192) and out.dtype == torch.bfloat16
    values = torch.from_numpy(E2M1_VALUES).double()
    lo, hi = values[(packed & 0xF).long()], values[(packed >> 4).long()]
    expected = torch.stack([lo, hi], -1).reshape(253, 8192) * torch.exp2(
        scale.double().repeat_interleave(32, dim=1) - 127
    )
    assert torch.equal(bits(out), bits(expected.to(torch.bfloat16)))  # exact, subnormal scales included
    assert torch.equal(out.double(), expected)


def test_decode_nibble_order_sign_and_negative_zero():
    # byte 0x71: low nibble 1 (0.5) is column 0, high nibble 7 (6.0) is column 1; 0x8F: -6.0 then -0.0.
    packed = torch.tensor([[0x71, 0x8F] + [0] * 14], dtype=torch.uint8)
    out = decode_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))  # scale 2
    assert out[0, :4].tolist() == [1.0, 12.0, -12.0, -0.0]
    assert bits(out[0, 3:4]).item() == -32768  # 0x8000: the sign of -0 survives


def test_decode_golden_two_blocks():
    row = torch.tensor([0x10, 0x32, 0x54, 0x76] * 4 + [0x10, 0x32, 0x54, 0x76] * 4, dtype=torch.uint8).view(1, 32)
    out = decode_mxfp4(row, torch.tensor([[127, 129]], dtype=torch.uint8))
    assert out[0, :8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert out[0, 32:40].tolist() == [0, 2, 4, 6, 8, 12, 16, 24]


def test_decode_float32_and_numpy_pairs_agree():
    g = torch.Generator().manual_seed(0)
    p = torch.randint(0, 256, (8, 48), dtype=torch.uint8, generator=g)
    s = torch.randint(100, 150, (8, 3), dtype=torch.uint8, generator=g)
    bf = decode_mxfp4(p, s)
    assert torch.equal(decode_mxfp4(p, s, dtype=torch.float32), bf.float())
    pairs = decode_mxfp4_pairs(p.numpy(), s.numpy())
    assert pairs.dtype == np.uint32 and pairs.shape == (8, 48)
    assert torch.equal(torch.from_numpy(pairs).view(torch.bfloat16), bf)


def test_decode_short_last_block():
    # 48 columns: one full block of 32 and a last block of 16 with its own scale.
    g = torch.Generator().manual_seed(1)
    p = torch.randint(0, 256, (4, 24), dtype=torch.uint8, generator=g)
    s = torch.randint(120, 130, (4, 2), dtype=torch.uint8, generator=g)
    padded = decode_mxfp4(torch.cat([p, torch.zeros(4, 8, dtype=torch.uint8)], 1), s)
    assert torch.equal(bits(decode_mxfp4(p, s)), bits(padded[:, :48]))


@pytest.mark.parametrize(
    "byte, message",
    [(255, "NaN in E8M0"), (253, "overflows BF16")],
)
def test_decode_rejects_nan_and_overflowing_scales(byte, message):
    s = torch.full((3, 2), 127, dtype=torch.uint8)
    s[2, 1] = byte
    with pytest.raises(MXFP4Error, match=rf"weight_scale\[2, 1\] = {byte} .*{message}"):
        decode_mxfp4(torch.zeros(3, 32, dtype=torch.uint8), s)


def test_decode_rejects_bad_shapes_and_dtypes():
    with pytest.raises(MXFP4Error, match="64 input columns need 2 scales"):
        decode_mxfp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(MXFP4Error, match="leading dims differ"):
        decode_mxfp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8))
    with pytest.raises(MXFP4Error, match="must be uint8"):
        decode_mxfp4(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 2, dtype=torch.uint8))


def test_packed_shapes():
    assert packed_shapes(3072, 3584) == ((3072, 1792), (3072, 112))  # w1/w3 of the release
    assert packed_shapes(3584, 3072) == ((3584, 1536), (3584, 96))  # w2
    with pytest.raises(MXFP4Error, match="must be even"):
        packed_shapes(4, 33)


# ------------------------------------------------------------------------------------------------ encode
def test_encode_matches_the_per_element_reference():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 96, generator=g) * torch.exp2(torch.randint(-20, 20, (6, 1), generator=g).float())
    w[0, :32] = 0.0  # an all-zero block
    w[1, 5] = -0.0
    w = w.to(torch.bfloat16)
    p, s = encode_mxfp4(w)
    rp, rs = reference_encode(w.double())
    assert torch.equal(s, rs) and torch.equal(p, rp)


def test_encode_rounds_ties_to_even_and_saturates():
    # With amax = 4 (block exponent 2, so shared exponent 0 and scale 1), the element grid is E2M1 itself.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # to the even code: 0, 2, 2, 4, 4, 6, 6
    above = [float(np.nextafter(np.float32(t), np.float32(9))) for t in ties]
    expected_above = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    w = torch.tensor([[4.0, *ties, *above, -5.0, -0.1, 0.0] + [0.0] * 14], dtype=torch.float32)
    p, s = encode_mxfp4(w)
    assert s.tolist() == [[127]]
    out = decode_mxfp4(p, s).float()[0]
    assert out[1:8].tolist() == expected
    assert out[8:15].tolist() == expected_above
    assert out[15].item() == -4.0 and out[16].item() == 0.0 and torch.signbit(out[16])  # -0.1 -> -0
    # amax 7.5: floor(log2) = 2 -> shared 0, so 7.5 saturates to 6 (the OCP rule; no wider scale).
    p, s = encode_mxfp4(torch.tensor([[7.5] + [0.0] * 31]))
    assert s.item() == 127 and decode_mxfp4(p, s)[0, 0].item() == 6.0


def test_encode_scale_extremes():
    w = torch.zeros(3, 32)
    w[1, 0] = 2.0**-140  # subnormal amax: the shared exponent clamps at -127 (scale byte 0)
    w[2, 0] = 2.0**127  # largest binade: floor(log2) - 2 = 125 -> byte 252
    p, s = encode_mxfp4(w)
    assert s[:, 0].tolist() == [0, 0, 252]
    assert decode_mxfp4(p, s)[2, 0].item() == 2.0**127


def test_encode_decode_round_trip_is_exact_on_representable_blocks():
    # A block whose largest code is 6 (4.0) or 7 (6.0) re-encodes to the same scale; every code (-0 included)
    # is then exact.
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (16, 256), dtype=torch.uint8, generator=g)
    codes[:, ::32] = torch.randint(6, 8, (16, 8), dtype=torch.uint8, generator=g)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.randint(1, 253, (16, 8), dtype=torch.uint8, generator=g)
    w = decode_mxfp4(packed, scale)
    p2, s2 = encode_mxfp4(w)
    assert torch.equal(s2, scale) and torch.equal(p2, packed)


def test_encode_short_last_block_equals_padding():
    w = torch.randn(5, 48, generator=torch.Generator().manual_seed(4))
    p, s = encode_mxfp4(w)
    pp, sp = encode_mxfp4(torch.cat([w, torch.zeros(5, 16)], 1))
    assert p.shape == (5, 24) and s.shape == (5, 2)
    assert torch.equal(p, pp[:, :24]) and torch.equal(s, sp)


def test_encode_rejects_bad_input():
    w = torch.zeros(2, 32)
    w[1, 7] = float("nan")
    with pytest.raises(MXFP4Error, match="row 1 column 7 = nan"):
        encode_mxfp4(w)
    w[1, 7] = float("inf")
    with pytest.raises(MXFP4Error, match="row 1 column 7 = inf"):
        encode_mxfp4(w)
    with pytest.raises(MXFP4Error, match="must be even"):
        encode_mxfp4(torch.zeros(2, 31))
    with pytest.raises(MXFP4Error, match="float tensor"):
        encode_mxfp4(torch.zeros(2, 32, dtype=torch.int32))


def test_encode_error_is_bounded_by_half_a_step():
    # Unsaturated elements (|v| / 2^shared <= 6) are within half an E2M1 step: <= 2^shared (the 4..6 step is 2).
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    p, s = encode_mxfp4(w)
    err = (decode_mxfp4(p, s).float() - w.float()).abs().view(64, 8, 32)
    step = torch.exp2(s.float() - 127).unsqueeze(-1)
    unsaturated = w.float().abs().view(64, 8, 32) <= 6 * step
    assert bool((err[unsaturated] <= step.expand_as(err)[unsaturated]).all())


# ------------------------------------------------------------------------------------------------ compressed-tensors
ct = pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def mxfp4_scheme():
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    return preset_name_to_scheme("MXFP4A16", ["Linear"])


def test_decode_matches_compressed_tensors_bit_for_bit(mxfp4_scheme):
    from compressed_tensors.compressors import MXFP4PackedCompressor

    g = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (253, 64), dtype=torch.uint8, generator=g)
    scale = torch.arange(253, dtype=torch.uint8).view(-1, 1).repeat(1, 4)  # every finite scale
    scale[:, 1:] = torch.randint(0, 253, (253, 3), dtype=torch.uint8, generator=g)
    ref = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, mxfp4_scheme)["weight"]
    assert ref.dtype == torch.bfloat16
    assert torch.equal(bits(decode_mxfp4(packed, scale)), bits(ref))


def ct_encode(w: torch.Tensor, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.compressors import MXFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    blocks = w.view(w.shape[0], -1, BLOCK_SIZE)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return out["weight_packed"], out["weight_scale"]


def test_encode_matches_compressed_tensors_outside_its_round_up_band(mxfp4_scheme):
    # compressed-tensors rounds a block's amax to the nearest power of two (up when the mantissa is >= 1.75)
    # before taking the exponent; OCP floors. Blocks whose amax mantissa is below 1.75 must agree bit for bit.
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 512, generator=g) * torch.exp2(torch.randint(-30, 10, (64, 1), generator=g).float())
    w = w.to(torch.bfloat16)
    blocks = w.float().view(64, 16, 32)
    amax = blocks.abs().amax(-1)
    mantissa = amax / torch.exp2(torch.floor(torch.log2(amax)))
    band = mantissa >= 1.75
    assert 50 < int(band.sum()) < 900  # both regions are well covered

    p, s = encode_mxfp4(w)
    cp, cs = ct_encode(w, mxfp4_scheme)
    codes, ct_codes = unpack_codes(p).view(64, 16, 32), unpack_codes(cp).view(64, 16, 32)
    assert torch.equal(s[~band], cs[~band])
    assert torch.equal(codes[~band], ct_codes[~band])

    # Inside the band compressed-tensors' exponent is exactly one higher, and its elements are our element
    # rounding at that exponent.
    assert torch.equal(cs[band].int(), s[band].int() + 1)
    rows, blks = band.nonzero(as_tuple=True)
    for r, b in list(zip(rows.tolist(), blks.tolist()))[:20]:
        shared = int(cs[r, b]) - 127
        ref = [reference_encode_element(float(v), shared) for v in blocks[r, b]]
        assert ct_codes[r, b].tolist() == ref
