"""The LoRA target table (``k3/settings/lora.py``): the shipped rows are the recipe's seven, bad rows are refused,
and one extra row (MLA's ``q_b_proj``, ``tests/lora_extra_target.py``) is all a new target takes: the config,
apply_lora, export, the PEFT files, the HF<->Megatron name map, the sharding rules and ``k3 train``'s validation
all take it without another line of code. The Megatron wrapper's side runs in
``tests/parity/test_megatron_lora_target_row.py`` (a torchrun worker)."""

from __future__ import annotations

import pytest
import torch
from lora_extra_target import Q_B_PROJ

from k3.checkpoint.names import hf_lora_to_megatron, megatron_lora_to_hf
from k3.config import variant
from k3.launch.args import LaunchConfigError, TrainArgs, resolve
from k3.lora import LoRAConfig, LoRAConfigError, apply_lora, lora_modules
from k3.lora.export import chunk_layout, export_chunks, load_peft_adapter, save_peft_adapter
from k3.lora.linear import LoRALinear
from k3.lora.sharding import ParallelLayout, factor_rule, gather, grad_sum_group, local_shape, shard
from k3.lora.targets import expected_sites
from k3.model import KimiK3ForCausalLM
from k3.settings import lora as lora_settings
from k3.settings.lora import (EXPORT_GROUPS, LoRATarget, ModuleKind, ParallelStyle, Placement, lora_target,
                              optional_target_names, target_names)

TINY = variant("tiny")  # 9 layers; MLA at 0-based 3, 7, 8; layer 0 dense; 8 experts, one shared expert
MLA = [3, 7, 8]
RANK, ALPHA = 4, 8.0
RECIPE = ("self_attention.o_proj", "self_attention.q_a_proj", "self_attention.kv_a_proj_with_mqa", "mlp.linear_fc1",
          "mlp.linear_fc2", "mlp.experts.linear_fc1", "mlp.experts.linear_fc2")
Q_B = "self_attention.q_b_proj"


@pytest.fixture
def q_b_row(monkeypatch):
    """The table with the extra row, for this test only."""
    monkeypatch.setattr(lora_settings, "LORA_TARGETS", (*lora_settings.LORA_TARGETS, Q_B_PROJ))
    return Q_B_PROJ


# ------------------------------------------------------------------------------------------------ the shipped table
def test_shipped_table_is_the_recipes_seven():
    assert target_names() == RECIPE
    assert optional_target_names() == ("mlp.experts.linear_fc2",)
    assert LoRAConfig().target_modules == RECIPE
    assert EXPORT_GROUPS == ("attention", "dense_mlp", "routed_experts", "shared_experts")
    styles = {t.name: t.style for t in lora_settings.LORA_TARGETS}
    assert styles == {
        "self_attention.o_proj": ParallelStyle.ROW_ALL_REDUCE,
        "self_attention.q_a_proj": ParallelStyle.DUPLICATED,
        "self_attention.kv_a_proj_with_mqa": ParallelStyle.DUPLICATED,
        "mlp.linear_fc1": ParallelStyle.COLUMN,
        "mlp.linear_fc2": ParallelStyle.ROW_REDUCE_SCATTER,
        "mlp.experts.linear_fc1": ParallelStyle.EXPERT_FC1,
        "mlp.experts.linear_fc2": ParallelStyle.EXPERT_FC2,
    }
    fc1 = lora_target("decoder.layers.*.mlp.linear_fc1")
    assert fc1.fused and fc1.megatron_module(lora_settings.SHARED_EXPERTS) == "mlp.shared_experts.linear_fc1"
    assert fc1.hf_modules(lora_settings.SHARED_EXPERTS) == ("block_sparse_moe.shared_experts.gate_proj",
                                                           "block_sparse_moe.shared_experts.up_proj")
    experts = lora_target("mlp.experts.linear_fc1")
    assert experts.module_kind is ModuleKind.LATENT_EXPERTS and experts.shared_expert_factor == "A"
    assert experts.hf_modules(lora_settings.ROUTED_EXPERTS) == ("block_sparse_moe.experts",)
    assert experts.peft_modules(lora_settings.ROUTED_EXPERTS) == ("block_sparse_moe.experts.w1",
                                                                 "block_sparse_moe.experts.w3")


def test_the_extra_target_is_unknown_without_its_row():
    with pytest.raises(LoRAConfigError, match=r"'self_attention.q_b_proj' is unknown"):
        LoRAConfig(target_modules=[Q_B])
    with pytest.raises(LaunchConfigError, match="--target-modules: unknown self_attention.q_b_proj"):
        resolve(TrainArgs(target_modules=[*RECIPE, Q_B], run_id="t"))
    with pytest.raises(Exception, match="unknown LoRA factor 'q_b_lora_A'"):
        factor_rule("q_b_lora_A")


@pytest.mark.parametrize("change, match", [
    ({"factors": ("q_b", "extra")}, "2 factors for 1 modules"),
    ({"modules": ("q_b_proj", "kv_b_proj"), "factors": ("q_b",), "style": ParallelStyle.DUPLICATED},
     "1 factors for 2 modules"),
    ({"style": ParallelStyle.EXPERT_FC1}, "does not fit placement MLA_LAYERS"),
    ({"placement": Placement.MOE_LAYERS}, "does not fit placement MOE_LAYERS"),
    ({"name": "mlp.q_b_proj"}, r"expected self_attention.<module>"),
    ({"name": "self_attention.inner.q_b_proj"}, r"expected self_attention.<module>"),
    ({"serving_names": ()}, "must each name at least one"),
])
def test_bad_rows_are_refused(change, match):
    fields = dict(name=Q_B_PROJ.name, placement=Q_B_PROJ.placement, modules=Q_B_PROJ.modules,
                  serving_names=Q_B_PROJ.serving_names, factors=Q_B_PROJ.factors, style=Q_B_PROJ.style,
                  features=Q_B_PROJ.features)
    with pytest.raises(LoRAConfigError, match=match):
        LoRATarget(**{**fields, **change})


# ------------------------------------------------------------------------------------------------ one more row
def test_config_and_peft_names_take_the_row(q_b_row):
    c = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=[Q_B, "self_attention.o_proj"])
    assert c.target_modules == ("self_attention.o_proj", Q_B)  # table order
    assert c.hf_target_modules() == ["o_proj", "q_b_proj"]
    assert LoRAConfig.from_peft_config(c.peft_config()) == c
    foreign = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_b_proj"]}
    assert LoRAConfig.from_peft_config(foreign).target_modules == (Q_B,)
    assert LoRAConfig().target_modules == (*RECIPE, Q_B)  # the default is every row


@pytest.fixture
def adapted(q_b_row):
    """Tiny K3 with the recipe's targets plus q_b_proj, every B random (so every adapter acts)."""
    torch.manual_seed(0)
    model = apply_lora(KimiK3ForCausalLM(TINY), LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=[*RECIPE, Q_B]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def test_apply_lora_adapts_q_b_proj_on_mla_layers_only(adapted):
    paths = {path for path, _ in lora_modules(adapted)}
    want = {f"model.layers.{i}.self_attn.q_b_proj" for i in MLA}
    assert {p for p in paths if p.endswith("q_b_proj")} == want
    assert {(s.target, s.module) for s in expected_sites(TINY, [Q_B])} == {(Q_B, p) for p in want}
    layer = adapted.model.layers[MLA[0]].self_attn
    q_b = layer.q_b_proj
    assert isinstance(q_b, LoRALinear)
    assert q_b.lora_A.shape == (RANK, TINY.q_lora_rank)
    assert q_b.lora_B.shape == (TINY.num_attention_heads * TINY.qk_head_dim, RANK)
    x = torch.randn(3, 5, TINY.q_lora_rank, generator=torch.Generator().manual_seed(2))
    reference = x @ q_b.weight.T + (ALPHA / RANK) * (x @ q_b.lora_A.T) @ q_b.lora_B.T  # W x + s·B A x
    torch.testing.assert_close(q_b(x), reference, rtol=1e-6, atol=1e-6)


def test_export_emits_q_b_tensors_with_peft_names_and_shapes(adapted):
    p = f"language_model.model.layers.{MLA[0]}.self_attn."
    out = TINY.num_attention_heads * TINY.qk_head_dim
    layout = {spec.layer: spec for spec in chunk_layout(TINY, adapted.lora_config) if spec.group == "attention"}
    names = [n for n, _ in layout[MLA[0]].tensors]
    assert names[-2:] == [p + "q_b_proj.lora_A.weight", p + "q_b_proj.lora_B.weight"]  # after kv_a: table order
    assert dict(layout[MLA[0]].tensors)[p + "q_b_proj.lora_B.weight"] == (out, RANK)
    assert not any("q_b_proj" in n for n, _ in layout[0].tensors)  # a KDA layer has none
    chunks = {(c.group, c.layer): c for c in export_chunks(adapted, version=1, dtype=torch.float32)}
    exported = dict(chunks[("attention", MLA[0])].tensors)
    q_b = adapted.model.layers[MLA[0]].self_attn.q_b_proj
    assert exported[p + "q_b_proj.lora_A.weight"].shape == (RANK, TINY.q_lora_rank)
    assert torch.equal(exported[p + "q_b_proj.lora_A.weight"], q_b.lora_A.detach())
    assert torch.equal(exported[p + "q_b_proj.lora_B.weight"], q_b.lora_B.detach())
    assert "q_b_proj" in chunks[("attention", MLA[0])].config["target_modules"]


def test_peft_files_round_trip_with_the_row(adapted, tmp_path):
    with torch.no_grad():  # the files hold BF16: start from adapters BF16 represents exactly
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(p.bfloat16().float())
    save_peft_adapter(adapted, tmp_path / "adapter")
    torch.manual_seed(5)
    fresh = load_peft_adapter(KimiK3ForCausalLM(TINY), tmp_path / "adapter")
    missing, unexpected = fresh.load_state_dict(
        {k: v for k, v in adapted.state_dict().items() if "lora_" not in k}, strict=False)
    assert unexpected == [] and all("lora_" in k for k in missing)
    assert fresh.lora_config.target_modules == (*RECIPE, Q_B)
    q_b_fresh = fresh.model.layers[MLA[0]].self_attn.q_b_proj
    q_b = adapted.model.layers[MLA[0]].self_attn.q_b_proj
    assert torch.equal(q_b_fresh.lora_A, q_b.lora_A) and torch.equal(q_b_fresh.lora_B, q_b.lora_B)
    ids = torch.randint(0, TINY.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(fresh(ids), adapted(ids), rtol=0, atol=0)


def test_name_map_covers_the_row(adapted):
    peft = {n: t for c in export_chunks(adapted, version=1, dtype=torch.float32) for n, t in c.tensors}
    mg = hf_lora_to_megatron(peft, TINY)
    for i in MLA:
        site = f"decoder.layers.{i}.self_attention.q_b_proj.lora."
        assert mg[site + "q_b_lora_A"].shape == (RANK, TINY.q_lora_rank)
        assert mg[site + "q_b_lora_B"].shape == (TINY.num_attention_heads * TINY.qk_head_dim, RANK)
    assert not any("q_b" in n for n in mg if n.startswith("decoder.layers.0."))
    back = megatron_lora_to_hf(mg, TINY)
    assert sorted(back) == sorted(peft)
    assert all(torch.equal(back[n], t) for n, t in peft.items())


def test_sharding_rules_follow_the_rows_style(q_b_row):
    A, B = factor_rule("q_b_lora_A"), factor_rule("q_b_lora_B")
    assert A.replicated and A.grad_sum == "tp"  # like fc1's A: its consumers are TP-sharded
    assert (B.split_dim, B.split_group, B.halves) == (0, "tp", False)  # one linear: no [gate; up] halves
    layout = ParallelLayout(tp=4)
    assert grad_sum_group("q_b_lora_A", layout) == "tp" and grad_sum_group("q_b_lora_B", layout) is None
    out = TINY.num_attention_heads * TINY.qk_head_dim
    assert local_shape("q_b_lora_B", (out, RANK), layout) == (out // 4, RANK)
    full = torch.arange(out * RANK, dtype=torch.float32).view(out, RANK)
    pieces = [shard(full, "q_b_lora_B", layout, k) for k in range(4)]
    assert torch.equal(pieces[1], full[out // 4: out // 2])
    assert torch.equal(gather(pieces, "q_b_lora_B"), full)


def test_k3_train_accepts_the_row(q_b_row):
    assert resolve(TrainArgs(target_modules=[*RECIPE, Q_B], run_id="t")).args.target_modules == [*RECIPE, Q_B]
    assert resolve(TrainArgs(target_modules=list(RECIPE), run_id="t")).args.target_modules == list(RECIPE)
    assert optional_target_names() == ("mlp.experts.linear_fc2", Q_B)
