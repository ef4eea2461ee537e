"""The released layout as data: counts, bytes, names/shapes/dtypes against the architecture reference §3, and the
reference model's state_dict."""

from __future__ import annotations

import math

import pytest
import torch

from k3.checkpoint.layout import QUANTIZED_WEIGHT_RE, TensorSpec, checkpoint_layout, layout_by_name
from k3.config import variant

P = "language_model."
REAL_CHECKPOINT_BYTES = 1_560_860_324_864  # the release, vision tower included (recipe §2.1)
REAL_CHECKPOINT_TENSORS = 497_220
VISION_TENSORS = 165 + 3  # vision_tower.* + mm_projector.*


@pytest.fixture(scope="module")
def full_mxfp4() -> list[TensorSpec]:
    return checkpoint_layout(variant("full"), "mxfp4")


def test_full_layout_matches_the_release_counts(full_mxfp4):
    cfg = variant("full")
    assert len(full_mxfp4) + VISION_TENSORS == REAL_CHECKPOINT_TENSORS
    bf16 = checkpoint_layout(cfg, "bf16")
    assert sum(math.prod(s.shape) for s in bf16) == cfg.parameter_counts(a_log_stored=True)["total"]
    text_bytes = sum(s.nbytes for s in full_mxfp4)
    assert text_bytes == 1_559_965_606_912
    # What remains of the release is the ~0.45B-parameter BF16 vision tower (arch §1.1: ~401M + projector).
    assert 0.8e9 < REAL_CHECKPOINT_BYTES - text_bytes < 1.0e9


def test_full_layout_names_shapes_dtypes_from_the_reference(full_mxfp4):
    by = {s.name: s for s in full_mxfp4}
    L = P + "model.layers."
    expect = {
        P + "model.embed_tokens.weight": ((163840, 7168), torch.bfloat16),
        P + "lm_head.weight": ((163840, 7168), torch.bfloat16),
        P + "model.output_attn_res_proj.weight": ((1, 7168), torch.bfloat16),
        L + "1.self_attn.q_conv1d.weight": ((12288, 1, 4), torch.float32),
        L + "1.self_attn.A_log": ((128,), torch.float32),
        L + "1.self_attn.dt_bias": ((12288,), torch.float32),
        L + "1.self_attn.o_norm.weight": ((128,), torch.float32),
        L + "1.self_attn.f_a_proj.weight": ((128, 7168), torch.bfloat16),
        L + "1.self_attn.f_b_proj.weight": ((12288, 128), torch.bfloat16),
        L + "1.self_attn.b_proj.weight": ((96, 7168), torch.bfloat16),
        L + "1.self_attn.o_proj.weight": ((7168, 12288), torch.bfloat16),
        L + "3.self_attn.q_b_proj.weight": ((18432, 1536), torch.bfloat16),
        L + "3.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), torch.bfloat16),
        L + "3.self_attn.kv_a_layernorm.weight": ((512,), torch.bfloat16),
        L + "3.self_attn.kv_b_proj.weight": ((24576, 512), torch.bfloat16),
        L + "3.self_attn.g_proj.weight": ((12288, 7168), torch.bfloat16),
        L + "0.mlp.gate_proj.weight": ((33792, 7168), torch.bfloat16),
        L + "0.mlp.down_proj.weight": ((7168, 33792), torch.bfloat16),
        L + "92.block_sparse_moe.gate.weight": ((896, 7168), torch.bfloat16),
        L + "92.block_sparse_moe.gate.e_score_correction_bias": ((896,), torch.float32),
        L + "92.block_sparse_moe.routed_expert_down_proj.weight": ((3584, 7168), torch.bfloat16),
        L + "92.block_sparse_moe.routed_expert_norm.weight": ((3584,), torch.bfloat16),
        L + "92.block_sparse_moe.shared_experts.up_proj.weight": ((6144, 7168), torch.bfloat16),
        L + "92.block_sparse_moe.experts.895.w1.weight_packed": ((3072, 1792), torch.uint8),
        L + "92.block_sparse_moe.experts.895.w1.weight_scale": ((3072, 112), torch.uint8),
        L + "92.block_sparse_moe.experts.895.w2.weight_packed": ((3584, 1536), torch.uint8),
        L + "92.block_sparse_moe.experts.895.w2.weight_scale": ((3584, 96), torch.uint8),
    }
    for name, (shape, dtype) in expect.items():
        assert (by[name].shape, by[name].dtype) == (shape, dtype), name
    # 1-based 92 and 93 (0-based 91, 92) are MLA, the latter the extra final one; 91 is KDA; layer 0 is dense
    assert L + "91.self_attn.q_a_proj.weight" in by and L + "92.self_attn.q_a_proj.weight" in by
    assert L + "90.self_attn.A_log" in by
    assert L + "0.block_sparse_moe.gate.weight" not in by and L + "1.mlp.gate_proj.weight" not in by
    # one expert: 16,515,072 B packed + 1,032,192 B scales (arch §3)
    expert = [s for s in full_mxfp4 if ".layers.5.block_sparse_moe.experts.7." in s.name]
    assert sum(s.nbytes for s in expert if s.role == "expert_packed") == 16_515_072
    assert sum(s.nbytes for s in expert if s.role == "expert_scale") == 1_032_192
    # Only routed experts are packed, and all of them are.
    packed = {s.weight_name for s in full_mxfp4 if s.role in ("expert_packed", "expert_scale")}
    assert all(QUANTIZED_WEIGHT_RE.search(n) for n in packed) and len(packed) == 92 * 896 * 3


def test_order_is_layer_by_layer_with_pairs_adjacent():
    specs = checkpoint_layout(variant("tiny"), "mxfp4")
    assert specs[0].name == P + "model.embed_tokens.weight" and specs[-1].name == P + "lm_head.weight"
    layers = [s.layer for s in specs if s.layer is not None]
    assert layers == sorted(layers)
    for a, b in zip(specs, specs[1:]):
        if a.role == "expert_packed":
            assert b.role == "expert_scale" and b.weight_name == a.weight_name
            assert a.logical_shape == b.logical_shape


def test_formats_describe_the_same_logical_tensors():
    cfg = variant("tiny")
    mx, bf = checkpoint_layout(cfg, "mxfp4"), layout_by_name(cfg, "bf16")
    logical = {s.weight_name: s.logical_shape or s.shape for s in mx}
    assert logical == {n: s.shape for n, s in bf.items()}
    for s in mx:
        if s.role == "expert_packed":
            assert bf[s.weight_name].role == "expert" and bf[s.weight_name].dtype == torch.bfloat16
        elif s.role != "expert_scale":
            assert (bf[s.name].dtype, bf[s.name].role) == (s.dtype, s.role)


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="format 'fp8': expected one of"):
        checkpoint_layout(variant("tiny"), "fp8")


@pytest.mark.parametrize("name, changes", [("tiny", {}), ("4layer", {"num_experts": 4, "num_experts_per_token": 2})])
def test_model_state_dict_equals_the_bf16_layout(name, changes):
    model_mod = pytest.importorskip("k3.model")
    cfg = variant(name).replace(quantization_config=None, **changes)
    with torch.device("meta"):
        model = model_mod.KimiK3ForCausalLM(cfg)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    layout = {s.name[len(P):]: s.shape for s in checkpoint_layout(cfg, "bf16")}
    assert state == layout
