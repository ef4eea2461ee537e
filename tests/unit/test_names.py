"""k3.checkpoint.names: the Megatron <-> HF map on the tiny K3, tensor by tensor."""

from __future__ import annotations

import pytest
import torch

from k3.checkpoint.names import (
    EXPERT_FC1,
    EXPERT_FC2,
    NameMapError,
    hf_names,
    hf_to_megatron,
    megatron_names,
    megatron_tensor,
    megatron_to_hf,
)
from k3.config import variant
from k3.model import KimiK3ForCausalLM


@pytest.fixture(scope="module")
def cfg():
    return variant("tiny").replace(quantization_config=None)


@pytest.fixture(scope="module")
def hf_state(cfg):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # Non-trivial values everywhere so a swapped or mis-sliced tensor cannot go unnoticed.
    g = torch.Generator().manual_seed(1)
    for k, v in sd.items():
        if not k.endswith("A_log"):
            sd[k] = torch.randn(v.shape, generator=g).to(v.dtype)
    return sd


def test_hf_names_cover_the_reference_state_dict(cfg, hf_state):
    assert sorted(hf_names(cfg)) == sorted(hf_state)


def test_round_trip_is_the_identity_tensor_by_tensor(cfg, hf_state):
    mg = hf_to_megatron(hf_state, cfg)
    assert list(mg) == megatron_names(cfg)
    back = megatron_to_hf(mg, cfg)
    assert sorted(back) == sorted(hf_state)
    for name, t in hf_state.items():
        assert back[name].dtype == t.dtype, name
        assert torch.equal(back[name], t), name


def test_megatron_layouts(cfg, hf_state):
    mg = hf_to_megatron(hf_state, cfg)
    L, E = cfg.num_hidden_layers, cfg.num_experts
    F, Lt, heads = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size, cfg.linear_attn_config.num_heads
    assert torch.equal(mg["embedding.word_embeddings.weight"], hf_state["model.embed_tokens.weight"])
    assert torch.equal(mg["output_layer.weight"], hf_state["lm_head.weight"])
    assert torch.equal(mg["decoder.final_layernorm.weight"], hf_state["model.norm.weight"])
    # dense fc1 = [gate; up]
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert torch.equal(fc1[: cfg.intermediate_size], hf_state["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[cfg.intermediate_size:], hf_state["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(mg["decoder.layers.0.pre_mlp_layernorm.weight"],
                       hf_state["model.layers.0.post_attention_layernorm.weight"])
    # shared experts fc1 = [gate; up]
    moe = "model.layers.1.block_sparse_moe."
    sfc1 = mg["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    S = cfg.shared_expert_intermediate_size
    assert torch.equal(sfc1[:S], hf_state[moe + "shared_experts.gate_proj.weight"])
    assert torch.equal(sfc1[S:], hf_state[moe + "shared_experts.up_proj.weight"])
    # experts stacked, each fc1 slice = [w1; w3]
    efc1, efc2 = mg[f"decoder.layers.1.{EXPERT_FC1}"], mg[f"decoder.layers.1.{EXPERT_FC2}"]
    assert efc1.shape == (E, 2 * F, Lt) and efc2.shape == (E, Lt, F)
    for e in range(E):
        assert torch.equal(efc1[e, :F], hf_state[f"{moe}experts.{e}.w1.weight"])
        assert torch.equal(efc1[e, F:], hf_state[f"{moe}experts.{e}.w3.weight"])
        assert torch.equal(efc2[e], hf_state[f"{moe}experts.{e}.w2.weight"])
    assert torch.equal(mg["decoder.layers.1.mlp.router.expert_bias"], hf_state[moe + "gate.e_score_correction_bias"])
    assert mg["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    # A_log: stored padded in HF, [heads] in Megatron
    a_log = mg["decoder.layers.0.self_attention.A_log"]
    assert a_log.shape == (heads,) and a_log.dtype == torch.float32
    assert hf_state["model.layers.0.self_attn.A_log"].shape == (cfg.a_log_stored_len,)
    assert torch.equal(a_log, hf_state["model.layers.0.self_attn.A_log"][:heads])
    # MLA tensors on MLA layers only; the model-level output AttnRes sits on the last layer
    mla = next(i for i in range(L) if not cfg.is_kda_layer(i))
    assert f"decoder.layers.{mla}.self_attention.q_a_proj.weight" in mg
    assert f"decoder.layers.{mla}.self_attention.A_log" not in mg
    assert torch.equal(mg[f"decoder.layers.{L - 1}.output_attn_res_proj.weight"],
                       hf_state["model.output_attn_res_proj.weight"])
    assert not any(k.startswith("decoder.layers.0.output_attn_res") for k in mg)


def test_experts_range_reads_only_those_experts(cfg, hf_state):
    read: list[str] = []

    def reader(n):
        read.append(n)
        return hf_state[n]

    t = megatron_tensor(f"decoder.layers.2.{EXPERT_FC1}", reader, cfg, experts=range(2, 4))
    full = hf_to_megatron(hf_state, cfg)[f"decoder.layers.2.{EXPERT_FC1}"]
    assert torch.equal(t, full[2:4])
    assert sorted({int(n.split(".experts.")[1].split(".")[0]) for n in read}) == [2, 3]
    with pytest.raises(NameMapError, match="outside"):
        megatron_tensor(f"decoder.layers.2.{EXPERT_FC1}", reader, cfg, experts=range(7, 9))


def test_partial_conversion_by_layer(cfg, hf_state):
    layer3 = {k: v for k, v in hf_state.items() if k.startswith("model.layers.3.")}
    mg = hf_to_megatron(layer3, cfg, layers=[3], top_level=False)
    assert all(k.startswith("decoder.layers.3.") for k in mg)
    assert sorted(megatron_to_hf(mg, cfg)) == sorted(layer3)


def test_unknown_hf_name_raises(cfg, hf_state):
    bad = dict(hf_state)
    bad["model.layers.0.self_attn.bogus.weight"] = torch.zeros(1)
    with pytest.raises(NameMapError, match="bogus"):
        hf_to_megatron(bad, cfg)


def test_missing_hf_name_raises(cfg, hf_state):
    bad = dict(hf_state)
    del bad["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    with pytest.raises(NameMapError, match=r"experts\.5\.w3\.weight.*missing"):
        hf_to_megatron(bad, cfg)


def test_nonzero_a_log_padding_raises(cfg, hf_state):
    bad = dict(hf_state)
    a = bad["model.layers.0.self_attn.A_log"].clone()
    a[-1] = 0.5
    bad["model.layers.0.self_attn.A_log"] = a
    with pytest.raises(NameMapError, match="A_log.*not zero"):
        hf_to_megatron(bad, cfg)


def test_unpadded_a_log_is_accepted(cfg, hf_state):
    heads = cfg.linear_attn_config.num_heads
    alt = dict(hf_state)
    alt["model.layers.0.self_attn.A_log"] = hf_state["model.layers.0.self_attn.A_log"][:heads]
    mg = hf_to_megatron(alt, cfg)
    assert torch.equal(mg["decoder.layers.0.self_attention.A_log"], alt["model.layers.0.self_attn.A_log"])


@pytest.mark.parametrize("name, match", [
    ("decoder.layers.0.self_attention.q_a_proj.weight", r"layer 0 \(KDA\+dense\) has no parameter"),
    ("decoder.layers.0.mlp.router.weight", r"layer 0 \(KDA\+dense\)"),
    ("decoder.layers.99.input_layernorm.weight", "past num_hidden_layers"),
    ("decoder.whatever", "not a K3 parameter"),
])
def test_unknown_megatron_name_raises(cfg, name, match):
    with pytest.raises(NameMapError, match=match):
        megatron_to_hf({name: torch.zeros(1)}, cfg)


def test_wrong_megatron_shapes_raise(cfg):
    with pytest.raises(NameMapError, match="leading expert dim"):
        megatron_to_hf({f"decoder.layers.1.{EXPERT_FC2}": torch.zeros(3, 4, 5)}, cfg)
    with pytest.raises(NameMapError, match="A_log.*expected"):
        megatron_to_hf({"decoder.layers.0.self_attention.A_log": torch.zeros(7)}, cfg)
    with pytest.raises(NameMapError, match="not divisible"):
        megatron_to_hf({"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(5, 2)}, cfg)


def test_mismatched_fused_halves_raise(cfg, hf_state):
    bad = dict(hf_state)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, cfg.hidden_size)
    with pytest.raises(NameMapError, match="differ"):
        hf_to_megatron(bad, cfg)


# ------------------------------------------------------------------------------------------------- LoRA names
@pytest.fixture(scope="module")
def peft_adapters(cfg):
    from k3.settings.lora import LoRAConfig
    from k3.lora.export import chunk_layout

    g = torch.Generator().manual_seed(3)
    out: dict[str, torch.Tensor] = {}
    for spec in chunk_layout(cfg, LoRAConfig(rank=4, alpha=8)):
        for name, shape in spec.tensors:
            out[name] = torch.randn(shape, generator=g)
    for name in list(out):  # the fused fc1 has one A: gate A = up A
        if name.endswith("up_proj.lora_A.weight"):
            out[name] = out[name.replace("up_proj", "gate_proj")]
    return out


def test_lora_round_trip_and_megatron_shapes(cfg, peft_adapters):
    from k3.checkpoint.names import hf_lora_to_megatron, megatron_lora_to_hf

    mg = hf_lora_to_megatron(peft_adapters, cfg)
    r, F, S = 4, cfg.intermediate_size, cfg.shared_expert_intermediate_size
    E, Fe, Lt = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    assert mg["decoder.layers.0.self_attention.o_proj.lora.o_lora_A"].shape == (r, cfg.kda_proj_size)
    assert mg["decoder.layers.0.mlp.linear_fc1.lora.fc1_lora_B"].shape == (2 * F, r)
    assert mg["decoder.layers.1.mlp.shared_experts.linear_fc1.lora.fc1_lora_B"].shape == (2 * S, r)
    assert mg["decoder.layers.1.mlp.experts.linear_fc1.lora.w1_lora_A"].shape == (r, Lt)
    assert mg["decoder.layers.1.mlp.experts.linear_fc1.lora.w3_lora_B"].shape == (E, Fe, r)
    assert mg["decoder.layers.1.mlp.experts.linear_fc2.lora.w2_lora_B"].shape == (Lt, r)
    assert mg["decoder.layers.3.self_attention.kv_a_proj_with_mqa.lora.kv_a_lora_B"].shape == (
        cfg.kv_lora_rank + cfg.qk_rope_head_dim, r)
    p = "language_model.model.layers.0.mlp."
    fc1_B = mg["decoder.layers.0.mlp.linear_fc1.lora.fc1_lora_B"]
    assert torch.equal(fc1_B[:F], peft_adapters[p + "gate_proj.lora_B.weight"])
    assert torch.equal(fc1_B[F:], peft_adapters[p + "up_proj.lora_B.weight"])
    back = megatron_lora_to_hf(mg, cfg)
    assert sorted(back) == sorted(peft_adapters)
    for name, t in peft_adapters.items():
        assert torch.equal(back[name], t), name


def test_lora_names_reject_bad_input(cfg, peft_adapters):
    from k3.checkpoint.names import hf_lora_to_megatron, megatron_lora_to_hf

    bad = dict(peft_adapters)
    p = "language_model.model.layers.0.mlp."
    bad[p + "up_proj.lora_A.weight"] = bad[p + "up_proj.lora_A.weight"] + 1
    with pytest.raises(NameMapError, match="gate and up lora_A differ"):
        hf_lora_to_megatron(bad, cfg)
    bad = dict(peft_adapters)
    del bad[p + "up_proj.lora_B.weight"]
    with pytest.raises(NameMapError, match="needs both"):
        hf_lora_to_megatron(bad, cfg)
    with pytest.raises(NameMapError, match="not a K3 LoRA target"):
        hf_lora_to_megatron({"language_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(1)}, cfg)
    with pytest.raises(NameMapError, match="does not belong"):
        megatron_lora_to_hf({"decoder.layers.0.self_attention.o_proj.lora.fc1_lora_A": torch.zeros(1)}, cfg)
    with pytest.raises(NameMapError, match="expected decoder.layers"):
        megatron_lora_to_hf({"o_lora_A": torch.zeros(1)}, cfg)
