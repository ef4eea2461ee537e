"""The megatron backend's guard, config and layer placement (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from k3.config import variant


@pytest.fixture(scope="module")
def cfg():
    return variant("tiny").replace(quantization_config=None)


def test_require_cuda_without_cuda_stops_and_names_backend_torch(monkeypatch):
    from k3.megatron.backend import MegatronBackendUnavailable, require_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MegatronBackendUnavailable) as err:
        require_cuda()
    message = str(err.value)
    assert "--backend megatron needs a CUDA GPU" in message
    assert "Use --backend torch" in message


def test_require_cuda_with_cuda_returns(monkeypatch):
    from k3.megatron.backend import require_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert require_cuda() is None


def test_transformer_config_carries_k3_and_the_layout(cfg):
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout

    c = k3_transformer_config(cfg, ParallelLayout.model_parallel(tp=2, ep=2), params_dtype=torch.bfloat16)
    assert c.k3 is cfg
    assert (c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size) == (2, 2, 1)
    assert c.sequence_parallel and c.bf16 and c.params_dtype == torch.bfloat16
    assert c.moe_layer_freq == [0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 32)
    assert c.moe_shared_expert_intermediate_size == cfg.shared_expert_intermediate_size
    assert c.moe_router_score_function == "sigmoid" and not c.moe_router_enable_expert_bias
    assert not k3_transformer_config(cfg).sequence_parallel  # no SP at TP1


@pytest.mark.parametrize("kwargs, match", [
    ({"sizes": (3, 1)}, r"linear_attn_config.num_heads=4 is not divisible by TP=3"),
    ({"sizes": (1, 3)}, r"num_experts=8 is not divisible by EP=3"),
    ({"dispatcher": "flex"}, r"dispatcher='flex'"),
    ({"params_dtype": torch.float16}, r"params_dtype"),
])
def test_transformer_config_rejects_bad_settings(cfg, kwargs, match):
    from k3.megatron.config import k3_transformer_config
    from k3.settings.parallel import ParallelLayout

    if "sizes" in kwargs:
        tp, ep = kwargs.pop("sizes")
        kwargs["layout"] = ParallelLayout.model_parallel(tp=tp, ep=ep)
    with pytest.raises(ValueError, match=match):
        k3_transformer_config(cfg, **kwargs)


def test_parallel_sizes_reject_non_positive():
    from k3.settings.parallel import ParallelLayout

    with pytest.raises(ValueError, match="ParallelLayout.tp=0"):
        ParallelLayout.model_parallel(tp=0)


@pytest.mark.parametrize("pp", [1, 3])
def test_spec_places_layer_kinds_by_global_index_for_every_stage(cfg, pp):
    from k3.megatron.config import k3_transformer_config
    from k3.megatron.kda import K3KDAttention
    from k3.megatron.layer import K3RMSNorm
    from k3.megatron.mla import K3MLAttention
    from k3.megatron.mlp import K3DenseMLP
    from k3.megatron.moe import K3LatentMoE
    from k3.megatron.spec import get_k3_spec, stage_layers
    from k3.settings.parallel import ParallelLayout

    config = k3_transformer_config(cfg, ParallelLayout.model_parallel(pp=pp))
    seen = []
    for rank in range(pp):
        layers = stage_layers(config, rank)
        spec = get_k3_spec(config, rank)
        assert spec.layer_norm is K3RMSNorm and len(spec.layer_specs) == len(layers)
        for j, (i, s) in enumerate(zip(layers, spec.layer_specs)):
            assert s.submodules.self_attention is (K3KDAttention if cfg.is_kda_layer(i) else K3MLAttention)
            assert s.submodules.mlp is (K3LatentMoE if cfg.is_moe_layer(i) else K3DenseMLP)
            assert s.params["unpack_input"] == (j == 0 and i > 0)
            assert s.params["pack_output"] == (j == len(layers) - 1 and i < cfg.num_hidden_layers - 1)
        seen += layers
    assert seen == list(range(cfg.num_hidden_layers))


def test_pushes_before_counts_the_bank_rows():
    from k3.megatron.layer import pushes_before

    # blocks of 12 open at 0, 12, 24, ...: layer 0 sees none, 1..12 see one, 13..24 two
    assert [pushes_before(i, 12) for i in (0, 1, 12, 13, 24, 25, 92)] == [0, 1, 1, 2, 2, 3, 8]
