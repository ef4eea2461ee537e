"""MXFP4 decode off the CPU codec: the torch fallback (CPU-runnable), the Triton kernel (CUDA), the dispatch, and
``k3 convert mxfp4-to-bf16 --device cuda``. Every decode is compared bit for bit with ``k3.kernels.mxfp4.codec``."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from k3.checkpoint import convert as convert_mod
from k3.checkpoint.convert import convert_mxfp4_to_bf16
from k3.checkpoint.hf_io import CheckpointError
from k3.checkpoint.synth import write_synthetic_checkpoint
from k3.config import variant
from k3.kernels.mxfp4 import triton as mxfp4_triton
from k3.kernels.mxfp4.codec import E8M0_MAX_FINITE_BF16, MXFP4Error, PairDecoder
from k3.kernels.mxfp4.codec import decode_mxfp4 as codec_decode
from k3.kernels.mxfp4.triton import (
    TorchPairDecoder,
    decode_mxfp4,
    decode_mxfp4_torch,
    triton_available,
)
from k3.launch.checkpoint_commands import convert_app

HAS_CUDA = torch.cuda.is_available()
needs_no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks the error without a CUDA device")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).cpu()


def every_byte_every_scale(lowest: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte in every row, row r scaled by E8M0 byte ``lowest + r`` up to 252 (every finite scale from 0:
    the general kernel; from 2: only normal numbers, the fast kernel)."""
    rows = E8M0_MAX_FINITE_BF16 + 1 - lowest
    packed = torch.arange(256, dtype=torch.int32).repeat(rows, 1).to(torch.uint8)
    scale = torch.arange(lowest, lowest + rows, dtype=torch.int32).to(torch.uint8).view(rows, 1).repeat(1, 256 // 16)
    return packed, scale


def random_mxfp4(shape: tuple[int, ...], seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed bytes ``shape`` and finite scales for them (``ceil(2 * shape[-1] / 32)`` per row)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    n_scales = -(-shape[-1] // 16)
    scale = torch.randint(0, E8M0_MAX_FINITE_BF16 + 1, (*shape[:-1], n_scales), generator=gen,
                          dtype=torch.int32).to(torch.uint8)
    return packed.to(device), scale.to(device)


# ------------------------------------------------------------------------------------------------ CPU: torch fallback
def test_torch_fallback_every_byte_and_every_finite_scale_is_the_codec():
    packed, scale = every_byte_every_scale()
    got = decode_mxfp4(packed, scale, impl="torch")
    assert got.dtype == torch.bfloat16 and got.shape == (253, 512)
    assert torch.equal(bits(got), bits(codec_decode(packed, scale)))
    # spot values by hand: byte 0x8F = hi code 8 (-0), lo code 15 (-6); scale byte 127 = 2^0; byte 0 is +0
    assert got[127, 2 * 0x8F].item() == -6.0 and bits(got)[127, 2 * 0x8F + 1].item() == -0x8000
    # the smallest scale: code 1 (0.5) * 2^-127 = 2^-128, a BF16 subnormal (bits 0x0020)
    assert bits(got)[0, 2 * 0x01].item() == 0x0020 and got[0, 2 * 0x01].item() == 2.0**-128


def test_torch_fallback_normal_only_path_every_byte_and_scale_from_2(monkeypatch):
    calls = []
    real = mxfp4_triton._normal_bits_torch
    monkeypatch.setattr(mxfp4_triton, "_normal_bits_torch", lambda *a: calls.append(1) or real(*a))
    packed, scale = every_byte_every_scale(lowest=2)
    got = decode_mxfp4(packed, scale, impl="torch")
    assert calls, "scales >= 2 take the normal-only form"
    assert torch.equal(bits(got), bits(codec_decode(packed, scale)))
    # scale byte 2, code 1: 0.5 * 2^-125 = 2^-126, the smallest normal BF16 (bits 0x0080)
    assert bits(got)[0, 2 * 0x01].item() == 0x0080
    calls.clear()
    decode_mxfp4(*every_byte_every_scale(lowest=1), impl="torch")
    assert not calls  # a scale byte of 1 needs the general (subnormal) form


@pytest.mark.parametrize("shape", [(3, 5, 17), (7, 40), (1, 1), (33, 48), (2, 0), (0, 16)])
def test_torch_fallback_matches_the_codec_on_any_shape(shape):
    # 3-D stacks, a short last block (17 bytes = 34 columns), empty tensors
    packed, scale = random_mxfp4(shape, seed=sum(shape))
    got = decode_mxfp4_torch(packed, scale)
    assert got.shape == (*shape[:-1], 2 * shape[-1]) and got.dtype == torch.bfloat16
    if got.numel():  # (the codec itself does not take empty tensors)
        assert torch.equal(bits(got), bits(codec_decode(packed, scale)))


def test_torch_fallback_chunks_rows_and_keeps_exactness(monkeypatch):
    monkeypatch.setattr(mxfp4_triton, "_TORCH_CHUNK_BYTES", 100)  # 3 rows of 32 bytes per step, 7 steps
    packed, scale = random_mxfp4((20, 32), seed=3)
    assert torch.equal(bits(decode_mxfp4(packed, scale, impl="torch")), bits(codec_decode(packed, scale)))


def test_non_contiguous_inputs_decode_like_their_copies():
    packed, scale = random_mxfp4((8, 64), seed=4)
    p, s = packed[::2], scale[::2]
    assert not p.is_contiguous()
    assert torch.equal(bits(decode_mxfp4(p, s, impl="torch")), bits(codec_decode(p.contiguous(), s.contiguous())))


@pytest.mark.parametrize("byte", [253, 254, 255])
def test_bad_scale_bytes_raise_the_codecs_message(byte):
    packed, scale = random_mxfp4((4, 32), seed=5)
    scale[2, 1] = byte
    scale[3, 0] = byte
    with pytest.raises(MXFP4Error) as codec_err:
        codec_decode(packed, scale)
    with pytest.raises(MXFP4Error) as ours:
        decode_mxfp4(packed, scale, impl="torch")
    assert str(ours.value) == str(codec_err.value)
    assert str(ours.value).startswith(f"weight_scale[2, 1] = {byte} (0x{byte:02X})")
    assert str(ours.value).endswith("; 2 such bytes")


def test_bad_dtypes_shapes_devices_and_impls_are_clear_errors():
    packed, scale = random_mxfp4((4, 32))
    with pytest.raises(MXFP4Error, match="must be uint8, got torch.int32 / torch.uint8"):
        decode_mxfp4(packed.int(), scale)
    with pytest.raises(MXFP4Error, match=re.escape("64 input columns need 2 scales per row (one per 32)")):
        decode_mxfp4(packed, scale[:, :1])
    with pytest.raises(MXFP4Error, match="leading dims differ"):
        decode_mxfp4(packed, scale[:3])
    with pytest.raises(MXFP4Error, match="must be torch tensors, got ndarray"):
        decode_mxfp4(packed.numpy(), scale)
    with pytest.raises(ValueError, match="impl='nope': expected auto, triton, torch or cpu"):
        decode_mxfp4(packed, scale, impl="nope")
    with pytest.raises(ValueError, match="device='meta': expected cpu or cuda"):
        decode_mxfp4(packed, scale, device="meta")
    if not mxfp4_triton._triton_interpreting():
        with pytest.raises(ValueError, match="impl='triton' runs on a CUDA device"):
            decode_mxfp4(packed, scale, impl="triton")


def test_auto_on_the_cpu_is_the_codec():
    packed, scale = random_mxfp4((6, 48), seed=6)
    assert torch.equal(bits(decode_mxfp4(packed, scale)), bits(codec_decode(packed, scale)))
    assert torch.equal(bits(decode_mxfp4(packed, scale, impl="cpu")), bits(codec_decode(packed, scale)))


@needs_no_cuda
def test_cuda_without_a_device_is_a_clear_error():
    packed, scale = random_mxfp4((4, 32))
    with pytest.raises(RuntimeError, match=r"device='cuda' but no CUDA device is available"):
        decode_mxfp4(packed, scale, device="cuda")
    with pytest.raises(RuntimeError, match="no CUDA device is available"):
        TorchPairDecoder("cuda")


def test_torch_pair_decoder_keeps_the_pair_decoders_contract():
    ours, theirs = TorchPairDecoder("cpu", impl="torch"), PairDecoder()
    for seed, shape in enumerate([(5, 40), (9, 40), (3, 17)]):  # the buffer grows, then is reused
        packed, scale = (t.numpy() for t in random_mxfp4(shape, seed=seed))
        got, want = ours.decode(packed, scale), theirs.decode(packed, scale)
        assert got.dtype == np.uint32 and got.shape == want.shape == shape
        assert np.array_equal(got, want)
    packed, scale = (t.numpy() for t in random_mxfp4((4, 32), seed=9))
    scale[1, 1] = 255
    with pytest.raises(MXFP4Error) as a:
        ours.decode(packed, scale)
    with pytest.raises(MXFP4Error) as b:
        theirs.decode(packed, scale)
    assert str(a.value) == str(b.value)
    with pytest.raises(MXFP4Error, match="must be uint8"):
        ours.decode(packed.astype(np.int8), scale)


# ------------------------------------------------------------------------------------------------ CPU: the converter
@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(variant("tiny"), tmp_path_factory.mktemp("gm") / "native", "mxfp4", seed=11,
                                      max_shard_size=200_000, progress=False)


@pytest.fixture(scope="module")
def converted_on_cpu(native, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gm_out") / "bf16"
    convert_mxfp4_to_bf16(native, out, progress=False)
    return out


def tree_hashes(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def test_converter_device_cuda_path_writes_the_same_bytes(native, converted_on_cpu, tmp_path, monkeypatch):
    # The --device cuda code path (TorchPairDecoder, its chunking) run on the CPU through the torch fallback.
    class OnCpu(TorchPairDecoder):
        def __init__(self, device="cuda", impl="auto"):
            super().__init__("cpu", impl="torch")

    monkeypatch.setattr(convert_mod, "_check_device", lambda device: None)
    monkeypatch.setattr(mxfp4_triton, "TorchPairDecoder", OnCpu)
    monkeypatch.setattr(convert_mod, "CUDA_DECODE_CHUNK_BYTES", 4096)  # several chunks per tensor
    out = tmp_path / "bf16"
    convert_mxfp4_to_bf16(native, out, progress=False, device="cuda", verify=True)
    assert tree_hashes(out) == tree_hashes(converted_on_cpu)


def test_converter_device_errors(native, tmp_path):
    with pytest.raises(CheckpointError, match="--device 'tpu': expected one of cpu, cuda"):
        convert_mxfp4_to_bf16(native, tmp_path / "o", progress=False, device="tpu")
    assert not (tmp_path / "o").exists()
    if not HAS_CUDA:
        with pytest.raises(CheckpointError, match=r"--device cuda: no CUDA device is available .*use --device cpu"):
            convert_mxfp4_to_bf16(native, tmp_path / "o", progress=False, device="cuda")
        assert not (tmp_path / "o").exists() and not convert_mod.staging_dir(tmp_path / "o").exists()


@needs_no_cuda
def test_cli_device_cuda_without_a_gpu_fails_clearly(native, tmp_path):
    r = CliRunner().invoke(convert_app, ["mxfp4-to-bf16", "--model-dir", str(native), "--save-dir",
                                         str(tmp_path / "o"), "--no-progress", "--device", "cuda"])
    assert r.exit_code == 1 and "error: --device cuda: no CUDA device is available" in r.output


def test_cli_rejects_an_unknown_device(native, tmp_path):
    r = CliRunner().invoke(convert_app, ["mxfp4-to-bf16", "--model-dir", str(native), "--save-dir",
                                         str(tmp_path / "o"), "--no-progress", "--device", "tpu"])
    assert r.exit_code == 2 and "tpu" in r.output


# ------------------------------------------------------------------------------------------------ CUDA
needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton is not importable")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("lowest", [0, 2])  # the general kernel, the normal-only kernel
def test_triton_every_byte_and_every_finite_scale_is_the_codec(lowest):
    packed, scale = every_byte_every_scale(lowest)
    want = bits(codec_decode(packed, scale))
    got = decode_mxfp4(packed.cuda(), scale.cuda(), impl="triton")
    assert got.is_cuda and got.dtype == torch.bfloat16
    assert torch.equal(bits(got), want)
    for block_rows, block_bytes, num_warps in [(8, 512, 8), (32, 128, 4), (4, 1024, 8)]:
        alt = decode_mxfp4(packed.cuda(), scale.cuda(), impl="triton", block_rows=block_rows,
                           block_bytes=block_bytes, num_warps=num_warps)
        assert torch.equal(bits(alt), want), (block_rows, block_bytes, num_warps)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 5, 17), (33, 48), (4, 3072, 1792), (2, 3584, 1536), (0, 16)])
def test_cuda_auto_and_fallback_match_the_codec(shape):
    packed, scale = random_mxfp4(shape, seed=len(shape))
    auto = decode_mxfp4(packed, scale, device="cuda")  # CPU inputs moved to the GPU
    fallback = decode_mxfp4(packed.cuda(), scale.cuda(), impl="torch")
    assert auto.device.type == "cuda" and auto.shape == fallback.shape == (*shape[:-1], 2 * shape[-1])
    if auto.numel():
        want = bits(codec_decode(packed, scale))
        assert torch.equal(bits(auto), want) and torch.equal(bits(fallback), want)


@pytest.mark.gpu
def test_cuda_bad_scale_is_the_codecs_message_and_impl_cpu_is_refused():
    packed, scale = random_mxfp4((4, 32), seed=5)
    scale[3, 1] = 255
    with pytest.raises(MXFP4Error) as codec_err:
        codec_decode(packed, scale)
    for impl in ("auto", "torch"):
        with pytest.raises(MXFP4Error) as ours:
            decode_mxfp4(packed.cuda(), scale.cuda(), impl=impl)
        assert str(ours.value) == str(codec_err.value)
    with pytest.raises(ValueError, match="impl='cpu' decodes on the CPU"):
        decode_mxfp4(packed, scale, device="cuda", impl="cpu")


@pytest.mark.gpu
@needs_triton
def test_triton_offsets_past_two_to_the_31():
    # 2.24e9 packed bytes, 8.96 GB of BF16: row offsets past int32 (the kernel indexes rows in int64)
    rows, n_bytes = 1_250_000, 1792
    gen = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (rows, n_bytes), generator=gen, device="cuda", dtype=torch.uint8)
    scale = torch.randint(0, 200, (rows, n_bytes // 16), generator=gen, device="cuda", dtype=torch.uint8)
    assert packed.numel() > 2**31
    out = decode_mxfp4(packed, scale, impl="triton")
    for sl in (slice(0, 64), slice(rows // 2, rows // 2 + 64), slice(rows - 64, rows)):
        want = codec_decode(packed[sl].cpu(), scale[sl].cpu())
        assert torch.equal(bits(out[sl]), bits(want)), sl
    del out, packed, scale
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_converter_on_cuda_writes_the_cpu_bytes(native, converted_on_cpu, tmp_path):
    out = tmp_path / "bf16"
    r = convert_mxfp4_to_bf16(native, out, progress=False, device="cuda", verify=True)
    assert r.verified
    assert tree_hashes(out) == tree_hashes(converted_on_cpu)
    out2 = tmp_path / "bf16_workers"
    convert_mxfp4_to_bf16(native, out2, progress=False, device="cuda", workers=2)
    assert tree_hashes(out2) == tree_hashes(converted_on_cpu)


# ------------------------------------------------------------------------------------------------ the bench runs
def test_bench_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_mxfp4.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_mxfp4", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "mx.json"
    result = bench.main(["--device", "cpu", "--experts", "2", "--width", "64", "--latent", "96",
                         "--converter-chunk-mib", "1", "--repeats", "2", "--warmup", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [t["shape"] for t in result["tables"]] == ["w1/w3 [E, 64, 96]", "w2 [E, 96, 64]"]
    for t in result["tables"]:
        assert t["rows"][0]["ratio_to_copy"] == 1.0
        assert all(r["exact"] for r in t["rows"][1:])
    assert result["converter_chunk"]["exact"]
    assert "| D2D copy of the BF16 output (anchor) |" in capsys.readouterr().out


def test_bad_triton_tiles_are_clear_errors(monkeypatch):
    packed, scale = random_mxfp4((4, 32))
    monkeypatch.setattr(mxfp4_triton, "_triton_interpreting", lambda: True)  # reach the launcher on the CPU
    monkeypatch.setattr(mxfp4_triton, "_mxfp4_decode_flat_kernel", None, raising=False)
    if mxfp4_triton.triton is None:
        with pytest.raises(RuntimeError, match="impl='triton' needs Triton"):
            decode_mxfp4(packed, scale, impl="triton")
        monkeypatch.setattr(mxfp4_triton, "triton", object())
    with pytest.raises(ValueError, match="block_bytes=100: expected a power of two"):
        decode_mxfp4(packed, scale, impl="triton", block_bytes=100)
    with pytest.raises(ValueError, match="block_rows \\* block_bytes = 8: expected at least 16"):
        decode_mxfp4(packed, scale, impl="triton", block_rows=1, block_bytes=8)
