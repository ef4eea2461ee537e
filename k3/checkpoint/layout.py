"""The released checkpoint layout as data: every text tensor's HF name, shape, dtype and role, layer by layer.

``checkpoint_layout(cfg, "mxfp4")`` is the native release (routed experts as ``weight_packed`` + ``weight_scale``),
``checkpoint_layout(cfg, "bf16")`` the converted one (each expert weight as a BF16 ``weight``). The order is the
writing order of the synthetic checkpoint: embedding, then layer by layer (norms, attention, AttnRes, FFN, experts
in index order), then the final norm/mix and the LM head, so shards group by layer as in the release.

Names carry the ``language_model.`` prefix; shapes are ``[out, in]`` for linear weights. Facts from the
architecture reference §3: conv weights, A_log (padded to ``a_log_stored_len``), dt_bias, o_norm and the router's
e_score_correction_bias are F32, everything else BF16, the packed parts U8.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from k3.checkpoint.hf_io import TEXT_PREFIX
from k3.config import K3Config
from k3.kernels.mxfp4.codec import packed_shapes

__all__ = [
    "FORMATS",
    "TensorSpec",
    "checkpoint_layout",
    "layout_by_name",
    "QUANTIZED_WEIGHT_RE",
    "SAFETENSORS_DTYPE",
]

FORMATS = ("mxfp4", "bf16")

# The only packed tensors of the release: routed expert w1/w2/w3 (llama.cpp refuses any other weight_packed).
QUANTIZED_WEIGHT_RE = re.compile(r"block_sparse_moe\.experts\.\d+\.w[123]\.weight$")

SAFETENSORS_DTYPE: dict[torch.dtype, str] = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor.

    ``role`` says what it is (and so how a synthetic checkpoint initialises it): ``embedding``, ``linear``,
    ``linear_out`` (a projection that writes the residual stream), ``norm``, ``res_proj``, ``conv``, ``a_log``,
    ``dt_bias``, ``router``, ``router_bias``, ``expert`` (a routed expert weight in BF16), ``expert_packed`` /
    ``expert_scale`` (its MXFP4 parts). ``logical_shape`` is the BF16 ``[out, in]`` a packed part decodes to.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str
    layer: int | None = None
    logical_shape: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def safetensors_dtype(self) -> str:
        return SAFETENSORS_DTYPE[self.dtype]

    @property
    def fan_in(self) -> int:
        """Input width of a linear weight (the last dim of its logical shape)."""
        return (self.logical_shape or self.shape)[-1]

    @property
    def weight_name(self) -> str:
        """The BF16 ``...weight`` name this tensor is (or decodes to)."""
        for suffix in (".weight_packed", ".weight_scale"):
            if self.name.endswith(suffix):
                return self.name[: -len(suffix)] + ".weight"
        return self.name


def checkpoint_layout(cfg: K3Config, fmt: str = "mxfp4") -> list[TensorSpec]:
    """Every text tensor of a K3 checkpoint in ``fmt`` (``mxfp4`` native, ``bf16`` converted), in writing order."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")
    specs: list[TensorSpec] = []
    bf16, f32 = torch.bfloat16, torch.float32
    H = cfg.hidden_size

    def add(name: str, shape: tuple[int, ...], role: str, layer: int | None = None, dtype=bf16) -> None:
        specs.append(TensorSpec(TEXT_PREFIX + name, tuple(shape), dtype, role, layer))

    def add_expert(name: str, out_features: int, in_features: int, layer: int) -> None:
        if fmt == "bf16":
            add(name + ".weight", (out_features, in_features), "expert", layer)
            return
        packed, scale = packed_shapes(out_features, in_features)
        logical = (out_features, in_features)
        specs.append(TensorSpec(TEXT_PREFIX + name + ".weight_packed", packed, torch.uint8, "expert_packed",
                                layer, logical))
        specs.append(TensorSpec(TEXT_PREFIX + name + ".weight_scale", scale, torch.uint8, "expert_scale",
                                layer, logical))

    add("model.embed_tokens.weight", (cfg.vocab_size, H), "embedding")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", (H,), "norm", i)
        if cfg.is_kda_layer(i):
            _kda(cfg, p + "self_attn.", i, add)
        else:
            _mla(cfg, p + "self_attn.", i, add)
        add(p + "post_attention_layernorm.weight", (H,), "norm", i)
        add(p + "self_attention_res_norm.weight", (H,), "norm", i)
        add(p + "self_attention_res_proj.weight", (1, H), "res_proj", i)
        add(p + "mlp_res_norm.weight", (H,), "norm", i)
        add(p + "mlp_res_proj.weight", (1, H), "res_proj", i)
        if cfg.is_moe_layer(i):
            m = p + "block_sparse_moe."
            Lt, F = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
            add(m + "gate.weight", (cfg.num_experts, H), "router", i)
            add(m + "gate.e_score_correction_bias", (cfg.num_experts,), "router_bias", i, f32)
            add(m + "routed_expert_down_proj.weight", (Lt, H), "linear", i)
            if cfg.latent_moe_use_norm:
                add(m + "routed_expert_norm.weight", (Lt,), "norm", i)
            add(m + "routed_expert_up_proj.weight", (H, Lt), "linear_out", i)
            if cfg.num_shared_experts:
                S = cfg.shared_expert_intermediate_size
                add(m + "shared_experts.gate_proj.weight", (S, H), "linear", i)
                add(m + "shared_experts.up_proj.weight", (S, H), "linear", i)
                add(m + "shared_experts.down_proj.weight", (H, S), "linear_out", i)
            for e in range(cfg.num_experts):
                add_expert(m + f"experts.{e}.w1", F, Lt, i)
                add_expert(m + f"experts.{e}.w2", Lt, F, i)
                add_expert(m + f"experts.{e}.w3", F, Lt, i)
        else:
            I = cfg.intermediate_size
            add(p + "mlp.gate_proj.weight", (I, H), "linear", i)
            add(p + "mlp.up_proj.weight", (I, H), "linear", i)
            add(p + "mlp.down_proj.weight", (H, I), "linear_out", i)
    add("model.norm.weight", (H,), "norm")
    add("model.output_attn_res_norm.weight", (H,), "norm")
    add("model.output_attn_res_proj.weight", (1, H), "res_proj")
    add("lm_head.weight", (cfg.vocab_size, H), "linear")
    return specs


def _kda(cfg: K3Config, p: str, i: int, add) -> None:
    H, P, hd = cfg.hidden_size, cfg.kda_proj_size, cfg.kda_head_dim
    K = cfg.linear_attn_config.short_conv_kernel_size
    f32 = torch.float32
    for x in "qkv":
        add(p + f"{x}_proj.weight", (P, H), "linear", i)
    for x in "qkv":
        add(p + f"{x}_conv1d.weight", (P, 1, K), "conv", i, f32)
    add(p + "f_a_proj.weight", (hd, H), "linear", i)
    add(p + "f_b_proj.weight", (P, hd), "linear", i)
    add(p + "b_proj.weight", (cfg.num_kda_heads, H), "linear", i)
    add(p + "g_proj.weight", (P, H), "linear", i)
    add(p + "A_log", (cfg.a_log_stored_len,), "a_log", i, f32)
    add(p + "dt_bias", (P,), "dt_bias", i, f32)
    add(p + "o_norm.weight", (hd,), "norm", i, f32)
    add(p + "o_proj.weight", (H, P), "linear_out", i)


def _mla(cfg: K3Config, p: str, i: int, add) -> None:
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    add(p + "q_a_proj.weight", (cfg.q_lora_rank, H), "linear", i)
    add(p + "q_a_layernorm.weight", (cfg.q_lora_rank,), "norm", i)
    add(p + "q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank), "linear", i)
    add(p + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), "linear", i)
    add(p + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), "norm", i)
    add(p + "kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "linear", i)
    add(p + "g_proj.weight", (nh * cfg.v_head_dim, H), "linear", i)
    add(p + "o_proj.weight", (H, nh * cfg.v_head_dim), "linear_out", i)


def layout_by_name(cfg: K3Config, fmt: str = "mxfp4") -> dict[str, TensorSpec]:
    """``checkpoint_layout`` keyed by name."""
    return {s.name: s for s in checkpoint_layout(cfg, fmt)}
