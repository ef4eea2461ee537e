"""Synthetic checkpoints: released layout, per-family init scales, determinism, shard planning, streaming memory,
the CLI, and a healthy tiny model; the random stream against a pure-Python reference, experts against the MXFP4
codec, the same bytes for any worker count (and on CUDA), and a failed or killed writer leaving nothing."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from k3.checkpoint import synth
from k3.checkpoint.hf_io import INDEX_NAME, CheckpointError, load_state_dict, read_safetensors_header
from k3.checkpoint.layout import TensorSpec, checkpoint_layout
from k3.checkpoint.synth import (
    TABLE_SIZE,
    default_workers,
    draws,
    plan_shards,
    stream_key,
    synthetic_config,
    synthetic_tensor,
    write_synthetic_checkpoint,
)
from k3.config import QUANTIZATION_CONFIG_MXFP4, K3Config, variant
from k3.kernels.mxfp4.codec import decode_mxfp4, encode_mxfp4
from k3.launch.checkpoint_commands import make_checkpoint

P = "language_model."


def file_hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny_mx(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "mx"
    write_synthetic_checkpoint(variant("tiny"), out, "mxfp4", seed=3, max_shard_size=200_000, progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_mx_tensors(tiny_mx) -> dict[str, torch.Tensor]:
    return load_state_dict(tiny_mx, strip_prefix=None)


def test_files_index_and_config_are_the_released_layout(tiny_mx):
    cfg = variant("tiny")
    index = json.loads((tiny_mx / INDEX_NAME).read_text())
    layout = checkpoint_layout(cfg, "mxfp4")
    assert sorted(index["weight_map"]) == sorted(s.name for s in layout)
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in layout)
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in tiny_mx.iterdir()) == sorted(shards + ["config.json", INDEX_NAME])
    by = {s.name: s for s in layout}
    for shard in shards:
        for name, e in read_safetensors_header(tiny_mx / shard).entries.items():
            assert (e.dtype, e.shape) == (by[name].safetensors_dtype, by[name].shape), name
            assert e.begin % {"F32": 4, "BF16": 2, "U8": 1}[e.dtype] == 0  # aligned for zero-copy loaders
    config = json.loads((tiny_mx / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and config["model_type"] == "kimi_k3"
    assert config["text_config"]["model_type"] == "kimi_linear"
    assert config["quantization_config"] == QUANTIZATION_CONFIG_MXFP4
    assert config["quantization_config"]["ignore"][0] == "re:.*self_attn.*"
    assert K3Config.from_json(tiny_mx) == cfg


def test_quantization_config_is_valid_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.quantization")
    q = ct.QuantizationConfig.model_validate(QUANTIZATION_CONFIG_MXFP4)
    w = q.config_groups["group_0"].weights
    assert q.format == "mxfp4-pack-quantized" and q.quantization_status == "compressed"
    assert (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric, w.scale_dtype) == (
        4, "float", "group", 32, True, torch.uint8)
    assert q.config_groups["group_0"].input_activations is None and q.kv_cache_scheme is None


def test_init_families(tiny_mx_tensors):
    cfg = variant("tiny")
    t = tiny_mx_tensors
    for s in checkpoint_layout(cfg, "mxfp4"):
        x = t[s.name]
        assert x.dtype == s.dtype and tuple(x.shape) == s.shape, s.name
        if s.role == "norm":
            assert torch.equal(x, torch.ones_like(x)), s.name
        elif s.role in ("res_proj", "router_bias"):
            assert torch.equal(x, torch.zeros_like(x)), s.name
        elif s.role == "a_log":
            heads = cfg.num_kda_heads
            assert torch.equal(x[heads:], torch.zeros(len(x) - heads)), s.name
            assert bool(((x[:heads].exp() >= 1) & (x[:heads].exp() <= 16)).all()), s.name
        elif s.role == "dt_bias":
            dt = torch.nn.functional.softplus(x.double())
            assert bool(((dt > 0.9e-4) & (dt < 0.1001)).all()) and dt.log().std() > 1, s.name
        elif s.role == "conv":
            bound = cfg.linear_attn_config.short_conv_kernel_size**-0.5
            assert x.abs().max() <= bound and x.std() > bound / 3, s.name
    # Linear std 1/sqrt(fan_in), residual outputs 1/sqrt(2 L fan_in), embedding 1: pooled per family.
    embed = t[P + "model.embed_tokens.weight"].float()
    assert abs(embed.std().item() - 1.0) < 0.03
    q = torch.cat([t[n].float().flatten() * 64**0.5 for n in t if n.endswith("self_attn.q_proj.weight")])
    assert abs(q.std().item() - 1.0) < 0.03
    o = torch.cat([t[n].float().flatten() * (2 * 9 * 64) ** 0.5 for n in t if n.endswith("self_attn.o_proj.weight")])
    assert abs(o.std().item() - 1.0) < 0.03
    w1 = [n for n in t if n.endswith("w1.weight_packed")]
    experts = torch.cat([decode_mxfp4(t[n], t[n[: -len("packed")] + "scale"]).float().flatten() for n in w1])
    assert abs(experts.std().item() * cfg.routed_expert_hidden_size**0.5 - 1.0) < 0.06  # MXFP4 adds a little


def test_bf16_format_holds_the_decoded_experts_of_the_same_seed(tmp_path, tiny_mx_tensors):
    out = write_synthetic_checkpoint(variant("tiny"), tmp_path / "bf", "bf16", seed=3, progress=False)
    bf = load_state_dict(out, strip_prefix=None)
    mx = tiny_mx_tensors
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    for name, x in bf.items():
        if name.endswith(("w1.weight", "w2.weight", "w3.weight")):
            base = name[: -len("weight")]
            assert torch.equal(x, decode_mxfp4(mx[base + "weight_packed"], mx[base + "weight_scale"])), name
        else:
            assert x.dtype == mx[name].dtype and torch.equal(x, mx[name]), name


def test_deterministic_for_a_seed_and_independent_of_shard_size(tmp_path, tiny_mx, tiny_mx_tensors):
    again = write_synthetic_checkpoint(variant("tiny"), tmp_path / "a", "mxfp4", seed=3, max_shard_size=200_000,
                                       progress=False)
    assert file_hashes(again) == file_hashes(tiny_mx)
    one = write_synthetic_checkpoint(variant("tiny"), tmp_path / "b", "mxfp4", seed=3, progress=False)
    assert len(list(one.glob("*.safetensors"))) == 1
    other = load_state_dict(one, strip_prefix=None)
    assert all(torch.equal(other[k], v) for k, v in tiny_mx_tensors.items())
    seed4 = load_state_dict(write_synthetic_checkpoint(variant("tiny"), tmp_path / "c", "mxfp4", seed=4,
                                                       progress=False), strip_prefix=None)
    name = P + "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(seed4[name], tiny_mx_tensors[name])


def test_plan_shards_keeps_pairs_together_and_respects_the_limit():
    specs = checkpoint_layout(variant("tiny"), "mxfp4")
    limit = 3000
    shards = plan_shards(specs, limit)
    assert [s for shard in shards for s in shard] == specs
    for shard in shards:
        size = sum(s.nbytes for s in shard)
        assert size <= limit or len({s.weight_name for s in shard}) == 1  # oversize: one tensor (or one pair)
        assert shard[0].role != "expert_scale"
        assert shard[-1].role != "expert_packed"


def test_refuses_a_non_empty_out_dir(tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty; pass --overwrite"):
        write_synthetic_checkpoint(variant("tiny"), out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    write_synthetic_checkpoint(variant("tiny"), out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / INDEX_NAME).exists()
    assert not list(tmp_path.glob(".*"))  # no staging or replaced folder left behind


def test_cli(tmp_path):
    runner = CliRunner()
    import typer

    app = typer.Typer()
    app.command()(make_checkpoint)
    out = tmp_path / "c"
    r = runner.invoke(app, ["--out", str(out), "--variant", "tiny", "--num-experts", "4", "--num-layers", "5",
                            "--format", "bf16", "--seed", "1", "--max-shard-size", "100KB", "--no-progress"])
    assert r.exit_code == 0, r.output
    cfg = K3Config.from_json(out)
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.num_hidden_layers) == (4, 2, 5)
    assert cfg.linear_attn_config.full_attn_layers == [4, 5] and cfg.quantization_config is None
    assert len(list(out.glob("*.safetensors"))) > 1
    assert re.search(r"wrote bf16 tiny checkpoint to .* in [0-9.]+ s \([0-9.]+ GB: files [0-9.]+ s, generate \+ "
                     r"write [0-9.]+ s \(([0-9.]+|inf) GB/s\), fsync [0-9.]+ s\)", r.output), r.output
    r = runner.invoke(app, ["--out", str(out)])
    assert r.exit_code == 1 and "not empty; pass --overwrite" in r.output
    r = runner.invoke(app, ["--out", str(tmp_path / "d"), "--max-shard-size", "lots"])
    assert r.exit_code == 1 and "expected a number with an optional unit" in r.output
    assert synthetic_config("4layer", num_experts=16).num_experts == 16


def test_timings_split_the_write_into_its_phases(tmp_path, monkeypatch):
    """``timings`` gets the three phases (each ≥ 0, together within the call's wall time) and the bytes written;
    the line the CLI prints from them reads each number back, the write's GB/s included."""
    fsynced = []
    monkeypatch.setattr(synth, "_fsync", lambda path: (fsynced.append(path.name), time.sleep(0.05)))
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    out = write_synthetic_checkpoint(variant("tiny"), tmp_path / "c", "bf16", progress=False, workers=1,
                                     timings=timings)
    wall = time.perf_counter() - t0
    assert sorted(timings) == ["bytes", "files_s", "fsync_s", "write_s"]
    assert timings["bytes"] == sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert all(timings[k] >= 0 for k in ("files_s", "write_s", "fsync_s"))
    assert timings["fsync_s"] >= 0.05 and fsynced  # the flush is its own phase
    assert timings["files_s"] + timings["write_s"] + timings["fsync_s"] <= wall
    text = synth.phases_text({"bytes": 12e9, "files_s": 0.06, "write_s": 10.0, "fsync_s": 4.44})
    assert text == "12.00 GB: files 0.1 s, generate + write 10.0 s (1.20 GB/s), fsync 4.4 s"


def test_streams_one_chunk_at_a_time(tmp_path):
    # A 1-shard checkpoint of ~0.28 GB must be written with far less memory than the shard: one chunk at a time.
    script = textwrap.dedent(f"""
        import resource, torch
        from k3.checkpoint.synth import write_synthetic_checkpoint, CHUNK_ELEMENTS
        from k3.config import variant
        cfg = variant("tiny").replace(vocab_size=65536, hidden_size=1024, intermediate_size=2048,
                                      num_hidden_layers=2, num_experts=2, num_experts_per_token=1)
        torch.empty(CHUNK_ELEMENTS, dtype=torch.bfloat16).normal_()  # allocator warm-up in the baseline
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        write_synthetic_checkpoint(cfg, {str(tmp_path / 'big')!r}, "bf16", max_shard_size=10**12, progress=False,
                                   workers=1)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(peak - base)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    (shard,) = (tmp_path / "big").glob("*.safetensors")
    assert shard.stat().st_size > 250e6
    assert int(r.stdout.strip()) < 150e6  # about one 64 MiB chunk (measured ~80 MB); never the 280 MB shard


def test_tiny_model_is_numerically_healthy(tmp_path):
    model_mod = pytest.importorskip("k3.model")
    out = write_synthetic_checkpoint(variant("tiny"), tmp_path / "bf", "bf16", seed=0, progress=False)
    model = model_mod.KimiK3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    assert bool(torch.isfinite(logits).all())
    assert 0.3 < logits.std().item() < 3.0  # neither collapsed nor exploding
    p = logits.softmax(-1)
    assert 0.003 < p.max(-1).values.mean().item() < 0.5  # peaked a little, far from one-hot


# ------------------------------------------------------------------------------------------------ the stream
MASK64 = (1 << 64) - 1


def reference_draws(key: int, start: int, count: int) -> list[int]:
    """The module docstring's definition in plain Python integers: splitmix64's finaliser of ``key + j * golden``
    mod 2^64, four little-endian 16-bit draws per word, each XOR 0x8000."""
    out = []
    for i in range(start, start + count):
        z = (key + (i // 4) * 0x9E3779B97F4A7C15) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        out.append(((z >> (16 * (i % 4))) & 0xFFFF) ^ 0x8000)
    return out


@pytest.mark.parametrize("start,count", [(0, 64), (3, 61), (1 << 40, 9), ((1 << 33) + 2, 7)])
def test_draws_match_the_reference(start, count):
    for key in (stream_key(0, "a"), stream_key(7, P + "model.layers.0.mlp.up_proj.weight"), -1, 0):
        assert draws(key, start, count).tolist() == reference_draws(key, start, count), (key, start)


def test_stream_key_is_the_seed_and_name():
    assert stream_key(0, "x") == stream_key(0, "x") != stream_key(1, "x") != stream_key(0, "y")
    assert -(1 << 63) <= stream_key(0, "x") < 1 << 63


def test_draws_do_not_depend_on_the_split():
    key = stream_key(5, "w")
    whole = draws(key, 10, 1000)
    parts = torch.cat([draws(key, 10, 3), draws(key, 13, 500), draws(key, 513, 497)])
    assert whole.dtype == torch.int32 and torch.equal(whole, parts)


def test_draws_are_uniform_16_bit_values():
    d = draws(stream_key(0, "uniform"), 0, 1 << 20).long()
    assert int(d.min()) >= 0 and int(d.max()) < TABLE_SIZE
    counts = torch.bincount(d, minlength=TABLE_SIZE).double()
    chi2 = ((counts - 16) ** 2 / 16).sum().item()  # 65535 degrees of freedom: mean 65535, sd ~362
    assert abs(chi2 - 65535) < 6 * 362
    for bit in range(16):  # every bit is a fair coin
        assert abs(((d >> bit) & 1).double().mean().item() - 0.5) < 0.005, bit
    u = d.double() / TABLE_SIZE - 0.5
    assert abs((u[1:] * u[:-1]).mean().item()) * 12 < 0.01  # neighbours (same word and across words) uncorrelated
    assert abs((u[4:] * u[:-4]).mean().item()) * 12 < 0.01


def reference_table(kind: str, scale: float, dtype: torch.dtype) -> torch.Tensor:
    q = (torch.arange(TABLE_SIZE, dtype=torch.float64) + 0.5) / TABLE_SIZE
    if kind == "normal":
        return (torch.special.ndtri(q) * scale).to(dtype)
    assert kind == "uniform"
    return ((2 * q - 1) * scale).to(dtype)


def spec_of(cfg: K3Config, fmt: str, role: str) -> TensorSpec:
    return next(s for s in checkpoint_layout(cfg, fmt) if s.role == role)


@pytest.mark.parametrize("role,kind", [("embedding", "normal"), ("linear", "normal"), ("linear_out", "normal"),
                                       ("conv", "uniform")])
def test_values_are_the_distribution_table_at_the_draws(role, kind):
    cfg = variant("tiny")
    s = spec_of(cfg, "mxfp4", role)
    scale = {"embedding": 1.0, "linear": s.fan_in**-0.5, "linear_out": (2 * cfg.num_hidden_layers * s.fan_in) ** -0.5,
             "conv": cfg.linear_attn_config.short_conv_kernel_size**-0.5}[role]
    got = torch.cat([chunk for _, chunk, _ in synthetic_tensor(s, cfg, seed=9)])
    d = draws(stream_key(9, s.name), 0, math.prod(s.shape)).long()
    assert got.dtype == s.dtype and tuple(got.shape) == s.shape
    assert torch.equal(got.flatten(), reference_table(kind, scale, s.dtype)[d])


def expert_spec(out_features: int, in_features: int, role: str) -> TensorSpec:
    name = P + "model.layers.1.block_sparse_moe.experts.0.w1"
    if role == "expert":
        return TensorSpec(name + ".weight", (out_features, in_features), torch.bfloat16, role, 1)
    return TensorSpec(name + ".weight_packed", (out_features, in_features // 2), torch.uint8, role, 1,
                      (out_features, in_features))


@pytest.mark.parametrize("out_features,in_features", [(40, 96), (7, 48), (3, 2), (130, 3584)])
def test_experts_are_the_codec_encoding_of_the_normal_values(out_features, in_features):
    # in 48 and 2: a short last block, padded inside; 3584: the release's width
    cfg = variant("tiny")
    d = draws(stream_key(4, P + "model.layers.1.block_sparse_moe.experts.0.w1.weight"), 0, out_features * in_features)
    values = reference_table("normal", in_features**-0.5, torch.bfloat16)[d.long()].view(out_features, in_features)
    want_packed, want_scale = encode_mxfp4(values)
    assert len(set(want_scale.flatten().tolist())) > 1 or out_features * in_features < 100  # scales do vary
    chunks = list(synthetic_tensor(expert_spec(out_features, in_features, "expert_packed"), cfg, seed=4))
    assert torch.equal(torch.cat([c for _, c, _ in chunks]), want_packed)
    assert torch.equal(torch.cat([s for _, _, s in chunks]), want_scale)
    bf16 = torch.cat([c for _, c, _ in synthetic_tensor(expert_spec(out_features, in_features, "expert"), cfg, 4)])
    assert torch.equal(bf16, decode_mxfp4(want_packed, want_scale))


def test_chunk_size_does_not_change_the_values(monkeypatch):
    cfg = variant("tiny")
    for role, fmt in (("linear", "mxfp4"), ("expert_packed", "mxfp4"), ("expert", "bf16"), ("a_log", "mxfp4")):
        s = spec_of(cfg, fmt, role)
        whole = list(synthetic_tensor(s, cfg, seed=2))
        monkeypatch.setattr(synth, "CHUNK_ELEMENTS", 100)
        small = list(synthetic_tensor(s, cfg, seed=2))
        monkeypatch.undo()
        assert len(small) > len(whole) == 1, role
        for k in (1, 2):
            if whole[0][k] is not None:
                assert torch.equal(torch.cat([c[k] for c in small]), whole[0][k]), role


# ------------------------------------------------------------------------------------------------ workers, devices
def assert_every_shard_present_and_indexed(out: Path, fmt: str) -> None:
    index = json.loads((out / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    for shard in shards:
        h = read_safetensors_header(out / shard)  # raises on a truncated file or trailing bytes
        assert sorted(h.entries) == sorted(n for n, f in index["weight_map"].items() if f == shard)
        assert h.metadata == {"format": "pt"}
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in checkpoint_layout(variant("tiny"), fmt))


def test_same_bytes_for_any_worker_count(tmp_path, tiny_mx):
    three = write_synthetic_checkpoint(variant("tiny"), tmp_path / "w3", "mxfp4", seed=3, max_shard_size=200_000,
                                       progress=False, workers=3)
    assert len(list(three.glob("*.safetensors"))) > 2
    assert_every_shard_present_and_indexed(three, "mxfp4")
    assert file_hashes(three) == file_hashes(tiny_mx)
    one = write_synthetic_checkpoint(variant("tiny"), tmp_path / "b1", "bf16", seed=3, max_shard_size=300_000,
                                     progress=False, workers=1)
    two = write_synthetic_checkpoint(variant("tiny"), tmp_path / "b2", "bf16", seed=3, max_shard_size=300_000,
                                     progress=False, workers=2)
    assert_every_shard_present_and_indexed(two, "bf16")
    assert file_hashes(two) == file_hashes(one)
    assert not list(tmp_path.glob(".*"))


def test_default_workers_follow_the_size_and_the_cpus():
    cpus = len(os.sched_getaffinity(0))
    assert default_workers(1) == 1 and default_workers(synth.BYTES_PER_AUTO_WORKER) == 1
    assert default_workers(2 * synth.BYTES_PER_AUTO_WORKER + 1) == min(3, cpus)
    assert default_workers(10**15) == min(cpus, synth.MAX_AUTO_WORKERS)


@pytest.mark.gpu
def test_cuda_writes_the_same_bytes(tmp_path, tiny_mx):
    for workers in (1, 2):
        gpu = write_synthetic_checkpoint(variant("tiny"), tmp_path / f"g{workers}", "mxfp4", seed=3,
                                         max_shard_size=200_000, progress=False, workers=workers, device="cuda")
        assert file_hashes(gpu) == file_hashes(tiny_mx), workers
    cpu = write_synthetic_checkpoint(variant("tiny"), tmp_path / "cb", "bf16", seed=3, progress=False)
    gpu = write_synthetic_checkpoint(variant("tiny"), tmp_path / "gb", "bf16", seed=3, progress=False, device="cuda")
    assert file_hashes(gpu) == file_hashes(cpu)
    key = stream_key(0, "x")
    assert draws(key, 5, 1 << 20, "cuda").cpu().equal(draws(key, 5, 1 << 20))


# ------------------------------------------------------------------------------------------------ bad input, failures
def test_refuses_bad_workers_and_devices(tmp_path):
    out = tmp_path / "x"
    with pytest.raises(CheckpointError, match="--workers 0: expected at least 1"):
        write_synthetic_checkpoint(variant("tiny"), out, workers=0, progress=False)
    with pytest.raises(CheckpointError, match="--device 'tpu': expected one of cpu, cuda"):
        write_synthetic_checkpoint(variant("tiny"), out, device="tpu", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="--device cuda: no CUDA device is available"):
            write_synthetic_checkpoint(variant("tiny"), out, device="cuda", progress=False)
    assert not list(tmp_path.iterdir())  # refused before anything was created


def test_cli_refuses_bad_workers_and_devices(tmp_path):
    import typer

    app = typer.Typer()
    app.command()(make_checkpoint)
    runner = CliRunner()
    r = runner.invoke(app, ["--out", str(tmp_path / "c"), "--workers", "0", "--no-progress"])
    assert r.exit_code == 1 and "--workers 0: expected at least 1" in r.output
    r = runner.invoke(app, ["--out", str(tmp_path / "c"), "--device", "tpu", "--no-progress"])
    assert r.exit_code == 2 and "Invalid value for '--device'" in r.output
    r = runner.invoke(app, ["--out", str(tmp_path / "c"), "--workers", "1", "--device", "cpu", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "wrote mxfp4 tiny checkpoint to" in r.output and not list(tmp_path.glob(".*"))


def test_a_failing_writer_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    real = synth._chunk
    monkeypatch.setattr(synth, "_chunk", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_synthetic_checkpoint(variant("tiny"), tmp_path / "x", progress=False, workers=1)
    assert not list(tmp_path.iterdir())  # no output, no staging folder


def test_a_killed_writer_leaves_no_checkpoint_and_no_workers(tmp_path):
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "big"
    script = textwrap.dedent(f"""
        from k3.checkpoint.synth import write_synthetic_checkpoint
        from k3.config import variant
        cfg = variant("tiny").replace(vocab_size=65536, hidden_size=1024, intermediate_size=2048,
                                      num_hidden_layers=4, num_experts=2, num_experts_per_token=1)
        write_synthetic_checkpoint(cfg, {str(out)!r}, "bf16", max_shard_size=50_000_000, progress=False, workers=2)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    staging = tmp_path / ".big.k3-synth-partial"
    try:
        deadline = time.monotonic() + 120
        children: list = []
        while time.monotonic() < deadline and sum("spawn_main" in " ".join(c.cmdline()) for c in children) < 2:
            time.sleep(0.1)
            assert proc.poll() is None, "the writer finished before it could be killed"
            children = psutil.Process(proc.pid).children()
        assert staging.is_dir() and sum("spawn_main" in " ".join(c.cmdline()) for c in children) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=30)  # the pool workers and multiprocessing's tracker
    assert not alive, "processes outlived their killed parent"
    assert not out.exists()  # only the hidden staging folder is left
    write_synthetic_checkpoint(variant("tiny"), out, progress=False)  # a rerun starts over
    assert not staging.exists() and (out / INDEX_NAME).exists()
