import json

import pytest

from k3.config import ConfigError, K3Config, variant


def test_full_counts_match_published():
    c = variant("full")
    counts = c.parameter_counts()
    assert counts["total"] == 2_779_484_476_000
    assert c.parameter_counts(a_log_stored=True)["total"] == 2_779_484_478_208
    assert counts["per_routed_expert"] == 33_030_144
    assert counts["active"] == 104_189_612_640


def test_4layer_count():
    assert variant("4layer").parameter_counts()["total"] == 93_993_894_688


def test_full_schedule():
    c = variant("full")
    mla = [i + 1 for i, (a, _) in enumerate(c.layer_kinds()) if a == "mla"]
    assert mla == list(range(4, 93, 4)) + [93]
    assert len(c.linear_attn_config.kda_layers) == 69
    assert c.attn_res_block_starts == [0, 12, 24, 36, 48, 60, 72, 84]
    assert c.attn_res_final_candidates == 9
    assert [k for _, k in c.layer_kinds()].count("dense") == 1 and c.layer_kinds()[0][1] == "dense"


def test_4layer_and_tiny_structure():
    f = variant("4layer")
    assert f.layer_kinds() == [("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe")]
    assert f.hidden_size == 7168 and f.num_experts == 896
    t = variant("tiny")
    assert t.num_hidden_layers >= 7 and t.attn_res_block_size == 3 and len(t.attn_res_block_starts) >= 3
    assert t.num_experts >= 8 and t.num_experts_per_token == 2 and t.routed_expert_hidden_size < t.hidden_size
    assert t.vocab_size <= 512 and t.num_shared_experts == 1
    assert [i + 1 for i, (a, _) in enumerate(t.layer_kinds()) if a == "mla"] == [4, 8, 9]


def test_roundtrip_released_wrapper(tmp_path):
    c = variant("full")
    p = tmp_path / "config.json"
    p.write_text(json.dumps(c.to_hf_dict()))
    d = json.loads(p.read_text())
    assert d["architectures"] == ["KimiK3ForConditionalGeneration"] and "text_config" in d
    c2 = K3Config.from_json(tmp_path)
    assert c2 == c
    # a bare text config reads the same
    assert K3Config.from_dict(d["text_config"]).num_hidden_layers == 93


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"hidden_act": "silu"}, "hidden_act='silu': expected 'situ'"),
        ({"num_experts_per_token": 9, "num_experts": 8}, "num_experts_per_token=9: expected <= num_experts (8)"),
        ({"hidden_size": 0}, "hidden_size=0: expected a positive integer"),
        ({"mla_use_nope": False}, "mla_use_nope=False"),
    ],
)
def test_validation_names_field(change, needle):
    d = variant("tiny").to_text_dict()
    d.update(change)
    with pytest.raises(ConfigError) as e:
        K3Config.from_dict(d)
    assert needle in str(e.value)


def test_validation_layer_lists():
    d = variant("tiny").to_text_dict()
    d["linear_attn_config"]["kda_layers"] = [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"layers \[4\] are in both"):
        K3Config.from_dict(d)
    d = variant("tiny").to_text_dict()
    d["linear_attn_config"]["kda_layers"] = [0, 1, 2, 3, 5, 6, 7]
    with pytest.raises(ConfigError, match="1-based layer numbers in 1..9"):
        K3Config.from_dict(d)
    d = variant("tiny").to_text_dict()
    d["linear_attn_config"]["kda_layers"] = [1, 2, 3, 5, 6]
    with pytest.raises(ConfigError, match=r"layers \[7\] \(1-based\) are in neither"):
        K3Config.from_dict(d)


def test_unknown_variant():
    with pytest.raises(ConfigError, match="unknown variant 'big'"):
        variant("big")
