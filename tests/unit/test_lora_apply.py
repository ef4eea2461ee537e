"""apply_lora on K3: the recipe's coverage per target, freezing, the no-op start, and the recipe's counts."""

from __future__ import annotations

import pytest
import torch

from k3.config import variant
from k3.lora import LoRAConfig, LoRAConfigError, apply_lora, lora_modules, lora_parameter_counts
from k3.lora.experts import LoRALatentExperts
from k3.lora.linear import LoRALinear
from k3.lora.targets import expected_sites, find_sites
from k3.model import KimiK3ForCausalLM

TINY = variant("tiny")  # 9 layers; MLA at 0-based 3, 7, 8; layer 0 dense; 8 experts, one shared expert
MLA = [3, 7, 8]


@pytest.fixture(scope="module")
def tiny_base():
    torch.manual_seed(0)
    return KimiK3ForCausalLM(TINY)


def _fresh(tiny_base):
    m = KimiK3ForCausalLM(TINY)
    m.load_state_dict(tiny_base.state_dict())
    return m


def test_coverage_is_the_recipes(tiny_base):
    m = apply_lora(_fresh(tiny_base), LoRAConfig())
    adapted = {path: type(mod) for path, mod in lora_modules(m)}
    want = set()
    for i in range(TINY.num_hidden_layers):
        p = f"model.layers.{i}."
        want.add(p + "self_attn.o_proj")
        if i in MLA:
            want |= {p + "self_attn.q_a_proj", p + "self_attn.kv_a_proj_with_mqa"}
        if i == 0:
            want |= {p + f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")}
        else:
            want |= {p + f"block_sparse_moe.shared_experts.{n}" for n in ("gate_proj", "up_proj", "down_proj")}
            want.add(p + "block_sparse_moe.experts")
    assert set(adapted) == want
    assert all(t is LoRALatentExperts for p, t in adapted.items() if p.endswith("experts"))
    assert all(t is LoRALinear for p, t in adapted.items() if not p.endswith("experts"))
    # KDA's own projections, the router and the latent projections stay plain
    assert type(m.model.layers[1].self_attn.q_proj) is torch.nn.Linear
    assert type(m.model.layers[1].block_sparse_moe.routed_expert_down_proj) is torch.nn.Linear


def test_only_adapters_train_and_a_fresh_adapter_changes_nothing(tiny_base):
    ids = torch.randint(0, TINY.vocab_size, (2, 6))
    before = tiny_base(ids)
    m = apply_lora(_fresh(tiny_base), LoRAConfig(rank=4, alpha=8))
    # zero B's: the same function; the routed experts' fused GEMMs (a longer K) may round in another order
    torch.testing.assert_close(m(ids), before, rtol=1e-6, atol=1e-6)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    m(ids).float().logsumexp(-1).sum().backward()
    assert all(p.grad is None for n, p in m.named_parameters() if "lora_" not in n)
    b_grads = [p.grad for n, p in m.named_parameters() if n.endswith("lora_B")]
    assert b_grads and all(g is not None and g.abs().sum() > 0 for g in b_grads)


def test_fc1_gate_and_up_share_one_A(tiny_base):
    m = apply_lora(_fresh(tiny_base), LoRAConfig(rank=4, alpha=8))
    dense = m.model.layers[0].mlp
    shared = m.model.layers[2].block_sparse_moe.shared_experts
    assert dense.gate_proj.lora_A is dense.up_proj.lora_A
    assert shared.gate_proj.lora_A is shared.up_proj.lora_A
    assert dense.gate_proj.lora_A is not shared.gate_proj.lora_A


def test_expert_fc2_is_optional_and_targets_select(tiny_base):
    m = apply_lora(_fresh(tiny_base), LoRAConfig(rank=4, alpha=8, target_modules=[
        "self_attention.o_proj", "mlp.experts.linear_fc1"]))
    experts = m.model.layers[1].block_sparse_moe.experts
    assert experts.factor_names() == ("w1_lora_A", "w1_lora_B", "w3_lora_A", "w3_lora_B")
    assert type(m.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    assert type(m.model.layers[3].self_attn.q_a_proj) is torch.nn.Linear


def test_base_state_dict_names_still_load(tiny_base):
    m = apply_lora(_fresh(tiny_base), LoRAConfig(rank=4, alpha=8))
    base_sd = tiny_base.state_dict()
    missing, unexpected = m.load_state_dict(base_sd, strict=False)
    assert unexpected == []
    assert missing and all("lora_" in k for k in missing)


def test_a_target_that_matches_nothing_raises():
    all_kda = TINY.replace(linear_attn_config={**TINY.linear_attn_config.__dict__,
                                               "kda_layers": list(range(1, 10)), "full_attn_layers": []})
    model = KimiK3ForCausalLM(all_kda)
    with pytest.raises(LoRAConfigError, match=r"'self_attention.q_a_proj' matches no module"):
        apply_lora(model, LoRAConfig(target_modules=["self_attention.o_proj", "self_attention.q_a_proj"]))
    assert not lora_modules(model)  # nothing attached, nothing frozen on failure
    assert all(p.requires_grad for p in model.parameters())


def test_modules_that_disagree_with_the_schedule_raise(tiny_base):
    m = _fresh(tiny_base)
    m.config = TINY.replace(first_k_dense_replace=2)  # claims layer 1 is dense; the module tree says MoE
    with pytest.raises(LoRAConfigError, match="layer schedule"):
        apply_lora(m, LoRAConfig())


def test_twice_or_bad_config_raises(tiny_base):
    m = apply_lora(_fresh(tiny_base), LoRAConfig(rank=2, alpha=2))
    with pytest.raises(TypeError, match="already"):
        apply_lora(m, LoRAConfig())
    with pytest.raises(TypeError, match="LoRAConfig"):
        apply_lora(_fresh(tiny_base), {"rank": 4})


def test_find_sites_agrees_with_the_schedule_on_every_variant():
    for name in ("tiny", "4layer"):
        cfg = variant(name)
        with torch.device("meta"):
            m = KimiK3ForCausalLM(cfg)
        found = {(s.target, s.module) for s in find_sites(m, LoRAConfig().target_modules)}
        assert found == {(s.target, s.module) for s in expected_sites(cfg, LoRAConfig().target_modules)}


@pytest.mark.parametrize("rank", [16, 32])
def test_full_model_adapter_size_is_the_recipes(rank):
    """§4.2: 766,017,024·r LoRA parameters on the full model (routed 760.7 M·r, shared 3.0 M·r, attention
    2.2 M·r, dense 0.12 M·r); built on the meta device, so nothing is allocated."""
    with torch.device("meta"):
        m = KimiK3ForCausalLM(variant("full"))
    apply_lora(m, LoRAConfig(rank=rank, alpha=2 * rank))
    trainable, _ = lora_parameter_counts(m)
    assert trainable == 766_017_024 * rank
    routed = sum(p.numel() for n, p in m.named_parameters() if p.requires_grad and ".experts." in n)
    assert routed == 92 * 8_268_288 * rank  # the routed chunk is r·8,268,288 elements per layer
