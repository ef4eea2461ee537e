"""Synthetic checkpoints: released layout, per-family init scales, determinism, shard planning, streaming memory,
the CLI, and a healthy tiny model."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from k3.checkpoint.hf_io import INDEX_NAME, CheckpointError, load_state_dict, read_safetensors_header
from k3.checkpoint.layout import checkpoint_layout
from k3.checkpoint.synth import plan_shards, synthetic_config, write_synthetic_checkpoint
from k3.config import QUANTIZATION_CONFIG_MXFP4, K3Config, variant
from k3.kernels.mxfp4.codec import decode_mxfp4
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
    r = runner.invoke(app, ["--out", str(out)])
    assert r.exit_code == 1 and "not empty; pass --overwrite" in r.output
    r = runner.invoke(app, ["--out", str(tmp_path / "d"), "--max-shard-size", "lots"])
    assert r.exit_code == 1 and "expected a number with an optional unit" in r.output
    assert synthetic_config("4layer", num_experts=16).num_experts == 16


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
        write_synthetic_checkpoint(cfg, {str(tmp_path / 'big')!r}, "bf16", max_shard_size=10**12, progress=False)
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
