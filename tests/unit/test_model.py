"""KimiK3ForCausalLM: decode == full forward, left padding, meta construction and counts, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3.checkpoint.hf_io import INDEX_NAME, CheckpointError
from k3.config import variant
from k3.model import K3Cache, KimiK3ForCausalLM
from k3.model.model import INIT_STD

ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny():
    """The tiny model with nonzero AttnRes pseudo-queries and router biases, so every path is exercised."""
    torch.manual_seed(0)
    cfg = variant("tiny")
    model = KimiK3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(std=0.3)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(std=0.05)
    return cfg, model.eval()


def ids(cfg, *shape, seed=0):
    return torch.randint(3, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_incremental_decode_equals_full_forward(tiny):
    cfg, model = tiny
    tokens = ids(cfg, 2, 12)
    with torch.no_grad():
        full = model(tokens)
        cache = model.init_cache(2)
        steps = torch.cat([model(tokens[:, t:t + 1], cache=cache) for t in range(12)], 1)
    assert cache.seen_tokens == 12
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_equals_full_forward(tiny):
    cfg, model = tiny
    tokens = ids(cfg, 1, 11, seed=1)
    with torch.no_grad():
        full = model(tokens)
        cache = model.init_cache(1)
        parts = [model(tokens[:, :5], cache=cache), model(tokens[:, 5:9], cache=cache),
                 model(tokens[:, 9:10], cache=cache), model(tokens[:, 10:], cache=cache)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)


def test_left_padded_batch_equals_each_sequence_alone(tiny):
    cfg, model = tiny
    a, b = ids(cfg, 1, 8, seed=2), ids(cfg, 1, 5, seed=3)
    pad = torch.full((1, 3), cfg.pad_token_id)
    batch = torch.cat([a, torch.cat([pad, b], 1)])
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask)
        alone_a, alone_b = model(a), model(b)
    assert torch.isfinite(padded).all()
    assert torch.equal(padded[1, :3], torch.zeros_like(padded[1, :3]))  # padding stays exact zeros to the end
    torch.testing.assert_close(padded[0], alone_a[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(padded[1, 3:], alone_b[0], atol=ATOL, rtol=0)

    # incremental: prefill the padded batch, then decode 3 more tokens for both rows
    more = ids(cfg, 2, 3, seed=4)
    with torch.no_grad():
        cache = model.init_cache(2)
        model(batch, cache=cache, attention_mask=mask)
        assert cache.attention_mask is not None and cache.attention_mask[1, :3].sum() == 0
        step_mask = mask
        decoded = []
        for t in range(3):
            step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=torch.long)], 1)
            decoded.append(model(more[:, t:t + 1], cache=cache, attention_mask=step_mask))
        decoded = torch.cat(decoded, 1)
        ref_a = model(torch.cat([a, more[:1]], 1))[:, 8:]
        ref_b = model(torch.cat([b, more[1:]], 1))[:, 5:]
    torch.testing.assert_close(decoded[0], ref_a[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(decoded[1], ref_b[0], atol=ATOL, rtol=0)


def test_padding_prefix_leaves_every_kda_state_zero(tiny):
    cfg, model = tiny
    cache = model.init_cache(2)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    with torch.no_grad():
        model(ids(cfg, 2, 4, seed=7), cache=cache, attention_mask=mask)
    for layer, state in enumerate(cache.layers):
        if cfg.is_kda_layer(layer):
            for t in (state.recurrent, state.conv_q, state.conv_k, state.conv_v):
                assert torch.equal(t[1], torch.zeros_like(t[1])), layer
                assert t[0].abs().sum() > 0


def test_mask_may_be_omitted_after_a_padded_prefill(tiny):
    cfg, model = tiny
    tokens = ids(cfg, 2, 4, seed=5)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        c1, c2 = model.init_cache(2), model.init_cache(2)
        model(tokens, cache=c1, attention_mask=mask)
        model(tokens, cache=c2, attention_mask=mask)
        nxt = ids(cfg, 2, 1, seed=6)
        implicit = model(nxt, cache=c1)
        explicit = model(nxt, cache=c2, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
    assert torch.equal(implicit, explicit)


def test_return_hidden(tiny):
    cfg, model = tiny
    tokens = ids(cfg, 2, 3)
    with torch.no_grad():
        logits, hidden = model(tokens, return_hidden=True)
    assert hidden.shape == (2, 3, cfg.hidden_size) and logits.shape == (2, 3, cfg.vocab_size)
    torch.testing.assert_close(logits, model.lm_head(hidden))


def test_bad_inputs_have_clear_errors(tiny):
    cfg, model = tiny
    tokens = ids(cfg, 2, 4)
    with pytest.raises(ValueError, match="only left padding"):
        model(tokens, attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"expected \[batch, cached \+ new\]"):
        model(tokens, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="1 \\(real token\\) / 0"):
        model(tokens, attention_mask=torch.full((2, 4), 2))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[cfg.vocab_size]]))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="made for batch 3"):
        model(tokens, cache=model.init_cache(3))
    cache = model.init_cache(2)
    with torch.no_grad():
        model(tokens, cache=cache)
    with pytest.raises(ValueError, match="differ from the mask"):
        model(tokens[:, :1], cache=cache, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="batch_size"):
        K3Cache(cfg, 0, torch.float32, "cpu")


def test_cache_holds_the_documented_state(tiny):
    cfg, model = tiny
    cache = model.init_cache(2)
    la = cfg.linear_attn_config
    kda = cache.layers[0]
    assert kda.recurrent.shape == (2, la.num_heads, la.head_dim, la.head_dim)
    assert kda.recurrent.dtype == torch.float32
    assert kda.conv_v.shape == (2, cfg.kda_proj_size, la.short_conv_kernel_size - 1)
    mla = cache.layers[3]
    assert mla.latent.shape == (2, 0, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    with torch.no_grad():
        model(ids(cfg, 2, 3), cache=cache)
    assert mla.latent.shape[1] == 3 and cache.seen_tokens == 3 and cache.nbytes() > 0


@pytest.mark.parametrize("name", ["full", "4layer"])
def test_meta_construction_matches_published_parameter_count(name):
    cfg = variant(name)
    with torch.device("meta"):
        model = KimiK3ForCausalLM(cfg, dtype=torch.bfloat16)
    assert all(p.is_meta for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert total == cfg.parameter_counts()["total"]
    if name == "full":
        assert total == 2_779_484_476_000
    else:
        assert total == 93_993_894_688
    names = dict(model.named_parameters())
    assert names["model.layers.1.block_sparse_moe.experts.w1"].shape == (cfg.num_experts, 3072, 3584)
    assert names["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert names["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_init_is_deterministic_and_healthy():
    cfg = variant("tiny")
    torch.manual_seed(7)
    m1 = KimiK3ForCausalLM(cfg)
    torch.manual_seed(7)
    m2 = KimiK3ForCausalLM(cfg)
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p1, p2), n
    m2.init_weights(seed=1)
    m1.init_weights(seed=1)
    assert torch.equal(m1.lm_head.weight, m2.lm_head.weight)
    attn = m1.model.layers[0].self_attn
    assert ((attn.A_log.exp() >= 1) & (attn.A_log.exp() <= 16)).all()
    dt = torch.nn.functional.softplus(attn.dt_bias)
    assert ((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)).all()
    assert m1.model.layers[2].mlp_res_proj.weight.abs().sum() == 0
    assert abs(m1.lm_head.weight.std().item() - INIT_STD) < 0.002
    with torch.no_grad():
        logits = m1(ids(cfg, 1, 16))
    assert torch.isfinite(logits).all() and 0.01 < logits.std().item() < 10


def test_training_backward_is_finite(tiny):
    cfg, model = tiny
    logits = model(ids(cfg, 2, 6))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids(cfg, 2, 6)[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) > 0.9 * len(list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- checkpoints


@pytest.fixture
def saved_bf16(tiny, tmp_path):
    cfg, model = tiny
    bf16 = KimiK3ForCausalLM(cfg, dtype=torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    bf16.save_pretrained(tmp_path, max_shard_size="300KB")
    return bf16, tmp_path


def test_save_pretrained_writes_the_released_layout(saved_bf16):
    _, path = saved_bf16
    index = json.loads((path / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0].endswith("-of-%05d.safetensors" % len(shards))
    assert all(n.startswith("language_model.") for n in index["weight_map"])
    assert "language_model.lm_head.weight" in index["weight_map"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in index["weight_map"]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    dtypes = {}
    for shard in shards:
        with safe_open(str(path / shard), "pt") as f:
            for n in f.keys():
                dtypes[n] = (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape())
    p = "language_model.model.layers.0.self_attn."
    assert dtypes[p + "A_log"] == ("F32", [128])
    assert dtypes[p + "q_conv1d.weight"][0] == "F32" and dtypes[p + "dt_bias"][0] == "F32"
    assert dtypes[p + "o_norm.weight"][0] == "F32" and dtypes[p + "q_proj.weight"][0] == "BF16"
    assert dtypes["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"][0] == "F32"


def test_round_trip_gives_identical_logits(saved_bf16):
    bf16, path = saved_bf16
    tokens = ids(bf16.config, 2, 7)
    loaded = KimiK3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), bf16(tokens))
    assert loaded.model.layers[0].self_attn.A_log.dtype == torch.float32
    loaded32 = KimiK3ForCausalLM.from_pretrained(path)  # default float32
    bf16_as_32 = KimiK3ForCausalLM(bf16.config)
    bf16_as_32.load_state_dict(bf16.state_dict())
    with torch.no_grad():
        assert torch.equal(loaded32(tokens), bf16_as_32(tokens))
    assert not any(p.is_meta for p in loaded32.parameters())


def test_unpadded_a_log_loads_too(saved_bf16, tmp_path_factory):
    bf16, _ = saved_bf16
    path = tmp_path_factory.mktemp("unpadded")
    sd = {k: v.clone() for k, v in bf16.state_dict().items()}
    heads = bf16.config.num_kda_heads
    for name in [n for n in sd if n.endswith(".A_log")]:
        sd[name] = sd[name][:heads].clone()
    save_file({"language_model." + k: v for k, v in sd.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(bf16.config.replace(quantization_config=None).to_hf_dict()))
    loaded = KimiK3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert torch.equal(loaded.model.layers[0].self_attn.A_log, bf16.model.layers[0].self_attn.A_log)


@pytest.fixture(scope="module")
def native_and_converted(tmp_path_factory):
    from k3.checkpoint.convert import convert_mxfp4_to_bf16
    from k3.checkpoint.synth import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("native")
    native = write_synthetic_checkpoint(variant("tiny"), root / "native", "mxfp4", seed=3, max_shard_size=1 << 20,
                                        progress=False)
    bf16 = root / "bf16"
    convert_mxfp4_to_bf16(native, bf16, workers=1, progress=False)
    return native, bf16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_mxfp4_loads_bit_identical_to_its_bf16_conversion(native_and_converted, dtype):
    native, bf16 = native_and_converted
    a = KimiK3ForCausalLM.from_pretrained(native, dtype=dtype)
    b = KimiK3ForCausalLM.from_pretrained(bf16, dtype=dtype)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert [n for n in sa if not torch.equal(sa[n], sb[n]) or sa[n].dtype != sb[n].dtype] == []
    assert a.config.quantization_config is None and a.config == b.config


def test_native_state_dict_decodes_every_packed_weight(native_and_converted):
    from k3.checkpoint.hf_io import load_state_dict, read_weight_map
    from k3.checkpoint.native import load_native_state_dict

    native, bf16 = native_and_converted
    packed = [n for n in read_weight_map(native) if n.endswith(".weight_packed")]
    assert packed  # the synthetic release packs its routed experts
    got, want = load_native_state_dict(native, progress=False), load_state_dict(bf16)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_native_checkpoint_missing_a_scale_is_refused_naming_it(native_and_converted, tmp_path):
    import shutil

    native, _ = native_and_converted
    broken = tmp_path / "broken"
    shutil.copytree(native, broken)
    index = json.loads((broken / INDEX_NAME).read_text())
    scale = sorted(n for n in index["weight_map"] if n.endswith(".weight_scale"))[0]
    del index["weight_map"][scale]
    (broken / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="scale"):
        KimiK3ForCausalLM.from_pretrained(broken)


def test_packed_weights_beside_a_bf16_config_are_refused(saved_bf16):
    _, path = saved_bf16
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    save_file({name: torch.zeros(32, 24, dtype=torch.uint8)}, str(path / "packed.safetensors"))
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"][name] = "packed.safetensors"
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"1 tensors are packed MXFP4 .*experts\.0\.w1\.weight_packed.*no "
                                              r"quantization_config: the checkpoint is inconsistent"):
        KimiK3ForCausalLM.from_pretrained(path)


def test_name_and_shape_mismatches_are_listed(saved_bf16, tmp_path_factory):
    bf16, _ = saved_bf16
    path = tmp_path_factory.mktemp("broken")
    sd = {k: v.clone() for k, v in bf16.state_dict().items()}
    del sd["model.layers.2.mlp_res_norm.weight"]
    sd["model.layers.2.extra.weight"] = torch.zeros(2)
    sd["model.norm.weight"] = torch.ones(3)
    save_file({"language_model." + k: v for k, v in sd.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(bf16.config.replace(quantization_config=None).to_hf_dict()))
    with pytest.raises(CheckpointError) as err:
        KimiK3ForCausalLM.from_pretrained(path)
    msg = str(err.value)
    assert "1 missing: model.layers.2.mlp_res_norm.weight" in msg
    assert "1 unexpected: model.layers.2.extra.weight" in msg
    assert "model.norm.weight (3,) (expected (64,))" in msg
