"""LoRAConfig: the launcher defaults, validation with clear errors, PEFT config round trip."""

from __future__ import annotations

import pytest

from k3.lora import LoRAConfig, LoRAConfigError
from k3.settings.lora import target_names


def test_defaults_are_the_launchers():
    c = LoRAConfig()
    assert (c.rank, c.alpha, c.dropout) == (16, 32.0, 0.0)
    assert c.scale == 2.0
    assert c.target_modules == target_names()
    assert len(target_names()) == 7
    assert LoRAConfig(rank=32, alpha=64).scale == 2.0
    assert LoRAConfig(rank=8, alpha=4).scale == 0.5


def test_megatron_prefix_is_accepted_and_order_normalized():
    c = LoRAConfig(target_modules=["decoder.layers.*.mlp.linear_fc2", "self_attention.o_proj",
                                   "mlp.linear_fc2"])
    assert c.target_modules == ("self_attention.o_proj", "mlp.linear_fc2")


@pytest.mark.parametrize("kwargs, field", [
    ({"rank": 0}, "rank"), ({"rank": 2.0}, "rank"), ({"rank": True}, "rank"),
    ({"alpha": 0}, "alpha"), ({"alpha": -1.0}, "alpha"),
    ({"dropout": 1.0}, "dropout"), ({"dropout": -0.1}, "dropout"),
    ({"target_modules": []}, "target_modules"), ({"target_modules": "self_attention.o_proj"}, "target_modules"),
    ({"experts_shared_outer": False}, "experts_shared_outer"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(LoRAConfigError, match=field):
        LoRAConfig(**kwargs)


def test_unknown_target_raises_with_the_known_list():
    with pytest.raises(LoRAConfigError, match=r"'self_attention.q_proj' is unknown.*mlp.experts.linear_fc1"):
        LoRAConfig(target_modules=["self_attention.q_proj"])
    with pytest.raises(LoRAConfigError, match="unknown"):
        LoRAConfig(target_modules=["decoder.layers.0.mlp.linear_fc1"])  # a layer index, not the * pattern


def test_peft_config_has_the_recipe_keys():
    d = LoRAConfig(rank=32, alpha=64).peft_config()
    assert d["peft_type"] == "LORA" and d["task_type"] == "CAUSAL_LM" and d["bias"] == "none"
    assert (d["r"], d["lora_alpha"], d["lora_dropout"]) == (32, 64.0, 0.0)
    # the HF target list miles sends to SGLang for the default targets
    assert d["target_modules"] == ["o_proj", "q_a_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj"]
    assert d["experts_shared_outer_loras"] is True


def test_hf_targets_follow_the_selection():
    assert LoRAConfig(target_modules=["self_attention.o_proj"]).hf_target_modules() == ["o_proj"]
    assert LoRAConfig(target_modules=["mlp.experts.linear_fc2"]).hf_target_modules() == ["down_proj"]


@pytest.mark.parametrize("targets", [target_names(), ("self_attention.o_proj", "mlp.experts.linear_fc1"),
                                     ("mlp.linear_fc2",)])
def test_peft_round_trip_is_exact(targets):
    c = LoRAConfig(rank=8, alpha=12.5, dropout=0.05, target_modules=targets)
    assert LoRAConfig.from_peft_config(c.peft_config()) == c


def test_peft_config_written_elsewhere_maps_hf_names_to_targets():
    d = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"]}
    c = LoRAConfig.from_peft_config(d)
    assert c.target_modules == ("self_attention.o_proj", "mlp.linear_fc2", "mlp.experts.linear_fc2")


@pytest.mark.parametrize("d, match", [
    ({"peft_type": "IA3", "r": 4, "lora_alpha": 8}, "peft_type"),
    ({"peft_type": "LORA", "lora_alpha": 8}, "'r'"),
    ({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "all"}, "bias"),
    ({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True}, "use_dora"),
    ({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, "none of them"),
])
def test_bad_peft_configs_raise(d, match):
    with pytest.raises(LoRAConfigError, match=match):
        LoRAConfig.from_peft_config(d, where="x/adapter_config.json")
