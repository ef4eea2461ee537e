"""K3Config: the Kimi-K3 text backbone's configuration, read from an HF ``config.json`` as released.

The released ``config.json`` is a multimodal wrapper (``KimiK3ForConditionalGeneration``) whose language model
sits under ``text_config``; ``linear_attn_config`` lists KDA and MLA layers **1-based**. ``K3Config`` accepts the
wrapper, a bare text config, or keyword fields, validates every field with an error that names it and the
expected value, and derives the per-layer schedule (KDA/MLA, dense/MoE, AttnRes block starts).

Layer indices in this class are **0-based** unless a name says ``one_based``.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["K3Config", "ConfigError", "variant", "VARIANTS", "QUANTIZATION_CONFIG_MXFP4"]


class ConfigError(ValueError):
    """A config field is missing or has a value K3 cannot run with."""


# The released checkpoint's quantization_config (compressed-tensors, weight-only MXFP4 on routed experts).
QUANTIZATION_CONFIG_MXFP4: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
                "dynamic": False,
                "scale_dtype": "torch.uint8",
                "observer": "minmax",
                "actorder": None,
                "block_structure": None,
                "observer_kwargs": {},
                "zp_dtype": None,
            },
            "input_activations": None,
            "output_activations": None,
            "format": "mxfp4-pack-quantized",
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
    "global_compression_ratio": None,
    "sparsity_config": {},
}


@dataclass
class LinearAttnConfig:
    """``text_config.linear_attn_config``: the KDA layers' shape and the 1-based layer lists."""

    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True
    kda_layers: list[int] = field(default_factory=list)  # 1-based
    full_attn_layers: list[int] = field(default_factory=list)  # 1-based


@dataclass
class K3Config:
    """Kimi-K3 text config. Field names are the HF ``text_config`` keys."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    rms_norm_eps: float = 1e-5
    # The HF reference builds q_a_layernorm / kv_a_layernorm with the class default 1e-6 (not the model eps).
    mla_latent_norm_eps: float = 1e-6
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    attn_res_block_size: int = 12
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    # Length A_log is stored with in the checkpoint (96 real heads + 32 zeros in the release).
    a_log_stored_len: int = 128
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    quantization_config: dict[str, Any] | None = None

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            known = {f.name for f in fields(LinearAttnConfig)}
            self.linear_attn_config = LinearAttnConfig(
                **{k: v for k, v in self.linear_attn_config.items() if k in known}
            )
        la = self.linear_attn_config
        if not la.kda_layers and not la.full_attn_layers:
            la.full_attn_layers = default_full_attn_layers(self.num_hidden_layers)
            la.kda_layers = [n for n in range(1, self.num_hidden_layers + 1) if n not in la.full_attn_layers]
        la.kda_layers = [int(n) for n in la.kda_layers]
        la.full_attn_layers = [int(n) for n in la.full_attn_layers]
        self.validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        """From a released wrapper config (with ``text_config``) or a bare text config.

        Unknown keys are ignored (the release carries many serving-only fields); ``quantization_config`` is taken
        from the text config or, failing that, from the wrapper's top level.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        text = d.get("text_config", d)
        if not isinstance(text, dict):
            raise ConfigError("text_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        kw = {k: copy.deepcopy(v) for k, v in text.items() if k in known}
        if "quantization_config" not in kw and "quantization_config" in d:
            kw["quantization_config"] = copy.deepcopy(d["quantization_config"])
        if "linear_attn_config" in kw and not isinstance(kw["linear_attn_config"], dict):
            raise ConfigError("linear_attn_config must be a JSON object")
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> "K3Config":
        """Read ``config.json`` (a file, or a checkpoint directory that holds one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"{p}: no config.json")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from e
        return cls.from_dict(d)

    from_pretrained = from_json

    def to_text_dict(self) -> dict[str, Any]:
        """The bare ``text_config`` dict, HF key names, with the HF model_type/architecture of the LM."""
        d = asdict(self)
        d.pop("mla_latent_norm_eps")
        d.pop("a_log_stored_len")
        if d["quantization_config"] is None:
            d.pop("quantization_config")
        d["model_type"] = "kimi_linear"
        d["architectures"] = ["KimiLinearForCausalLM"]
        d["head_dim"] = self.hidden_size // self.num_attention_heads  # as the release: unused
        d["dtype"] = "bfloat16"
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """The released wrapper layout: top-level ``KimiK3ForConditionalGeneration`` + ``text_config``."""
        text = self.to_text_dict()
        out: dict[str, Any] = {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "media_placeholder_token_id": 163605,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }
        if self.quantization_config is not None:
            out["quantization_config"] = copy.deepcopy(self.quantization_config)
        return out

    def replace(self, **changes: Any) -> "K3Config":
        """A copy with fields changed (layer lists re-derived when ``num_hidden_layers`` changes alone)."""
        d = asdict(self)
        if "num_hidden_layers" in changes and "linear_attn_config" not in changes:
            d["linear_attn_config"]["kda_layers"] = []
            d["linear_attn_config"]["full_attn_layers"] = []
        la_changes = changes.pop("linear_attn_config", None)
        d.update(changes)
        if la_changes is not None:
            d["linear_attn_config"].update(
                la_changes if isinstance(la_changes, dict) else asdict(la_changes)
            )
        return K3Config(**d)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first field that is out of range."""

        def need(cond: bool, name: str, expected: str) -> None:
            if not cond:
                raise ConfigError(f"{name}={getattr_path(self, name)!r}: expected {expected}")

        for name in (
            "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads q_lora_rank "
            "kv_lora_rank qk_nope_head_dim v_head_dim num_experts num_experts_per_token "
            "moe_intermediate_size routed_expert_hidden_size attn_res_block_size"
        ).split():
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "a positive integer")
        need(isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0, "qk_rope_head_dim",
             "a non-negative integer")
        need(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads",
             f"== num_attention_heads ({self.num_attention_heads}); K3's MLA has no grouped KV")
        need(self.hidden_act == "situ", "hidden_act", "'situ'")
        need(self.activation_situ_beta > 0, "activation_situ_beta", "> 0")
        need(self.activation_situ_linear_beta > 0, "activation_situ_linear_beta", "> 0")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "> 0")
        need(self.mla_use_nope is True, "mla_use_nope", "true (K3 applies no RoPE)")
        need(self.mla_use_output_gate is True, "mla_use_output_gate", "true")
        need(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func", "'sigmoid'")
        need(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
             f"<= num_experts ({self.num_experts})")
        need(self.num_shared_experts >= 0, "num_shared_experts", ">= 0")
        need(self.first_k_dense_replace >= 0, "first_k_dense_replace", ">= 0")
        need(self.moe_layer_freq >= 1, "moe_layer_freq", ">= 1")
        need(self.num_expert_group == 1 and self.topk_group == 1, "num_expert_group",
             "1 (with topk_group 1; K3's grouped top-k is a no-op)")
        need(not self.tie_word_embeddings, "tie_word_embeddings", "false (K3's embeddings are untied)")
        need(self.num_nextn_predict_layers == 0, "num_nextn_predict_layers", "0 (no MTP weights in the release)")
        la = self.linear_attn_config
        for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
            v = getattr(la, name)
            need(isinstance(v, int) and v > 0, f"linear_attn_config.{name}", "a positive integer")
        need(la.gate_lower_bound is None or la.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound",
             "a negative number or null")
        need(la.use_full_rank_gate is True, "linear_attn_config.use_full_rank_gate", "true")
        need(self.a_log_stored_len >= la.num_heads, "a_log_stored_len",
             f">= linear_attn_config.num_heads ({la.num_heads})")
        L = self.num_hidden_layers
        allowed = set(range(1, L + 1))
        kda, full = la.kda_layers, la.full_attn_layers
        for name, lst in (("kda_layers", kda), ("full_attn_layers", full)):
            bad = [n for n in lst if n not in allowed]
            if bad:
                raise ConfigError(
                    f"linear_attn_config.{name} has {bad}: expected 1-based layer numbers in 1..{L}"
                )
            if len(set(lst)) != len(lst):
                raise ConfigError(f"linear_attn_config.{name} lists a layer twice: {lst}")
        both = sorted(set(kda) & set(full))
        if both:
            raise ConfigError(
                f"linear_attn_config: layers {both} are in both kda_layers and full_attn_layers: expected disjoint"
            )
        missing = sorted(allowed - set(kda) - set(full))
        if missing:
            raise ConfigError(
                f"linear_attn_config: layers {missing} (1-based) are in neither kda_layers nor full_attn_layers: "
                f"expected every layer 1..{L} in exactly one list"
            )
        need(self.first_k_dense_replace <= L, "first_k_dense_replace", f"<= num_hidden_layers ({L})")
        if self.quantization_config is not None:
            q = self.quantization_config
            need(isinstance(q, dict), "quantization_config", "a JSON object or null")

    # ------------------------------------------------------------------ derived
    @property
    def num_kda_heads(self) -> int:
        return self.linear_attn_config.num_heads

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config.head_dim

    @property
    def kda_proj_size(self) -> int:
        """KDA q/k/v/g projection width, ``num_heads * head_dim`` (12288 for full)."""
        return self.num_kda_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key head dim, nope + rope (192 for full)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Width of the shared-expert MLP: the shared experts are one MLP of ``num_shared * moe_inter``."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def is_quantized(self) -> bool:
        return self.quantization_config is not None

    def is_kda_layer(self, layer: int) -> bool:
        """0-based ``layer`` is KDA (else MLA)."""
        return (layer + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, layer: int) -> bool:
        """0-based ``layer`` has the latent MoE (else the dense SiTU MLP)."""
        return layer >= self.first_k_dense_replace and (layer % self.moe_layer_freq == 0)

    def layer_kinds(self) -> list[tuple[str, str]]:
        """Per 0-based layer: (``"kda"|"mla"``, ``"dense"|"moe"``)."""
        return [
            ("kda" if self.is_kda_layer(i) else "mla", "moe" if self.is_moe_layer(i) else "dense")
            for i in range(self.num_hidden_layers)
        ]

    def is_block_start(self, layer: int) -> bool:
        """AttnRes: 0-based ``layer`` opens a block (its input is pushed to the bank after the mix)."""
        return layer % self.attn_res_block_size == 0

    @property
    def attn_res_block_starts(self) -> list[int]:
        """0-based layers where the AttnRes bank is pushed (0, 12, …, 84 for full)."""
        return [i for i in range(self.num_hidden_layers) if self.is_block_start(i)]

    @property
    def attn_res_final_candidates(self) -> int:
        """How many vectors the final mix sees: every stored block plus the live partial sum."""
        return len(self.attn_res_block_starts) + 1

    # ------------------------------------------------------------------ parameter counts
    def parameter_counts(self, a_log_stored: bool = False) -> dict[str, int]:
        """Text-parameter counts from the shapes alone (no allocation).

        Returns ``total`` (both embeddings included), ``per_routed_expert``, ``active`` (per token: everything
        but the input embedding and the unselected routed experts). ``a_log_stored=True`` counts A_log at its
        stored length (128) instead of ``num_heads``.
        """
        H, V = self.hidden_size, self.vocab_size
        la = self.linear_attn_config
        P = self.kda_proj_size
        a_log = self.a_log_stored_len if a_log_stored else la.num_heads
        kda = (
            3 * P * H  # q,k,v
            + 3 * P * la.short_conv_kernel_size  # convs
            + la.head_dim * H + P * la.head_dim  # f_a, f_b
            + la.num_heads * H  # b_proj
            + P * H  # g_proj
            + a_log + P + la.head_dim  # A_log, dt_bias, o_norm
            + H * P  # o_proj
        )
        nh = self.num_attention_heads
        mla = (
            self.q_lora_rank * H + self.q_lora_rank + nh * self.qk_head_dim * self.q_lora_rank
            + (self.kv_lora_rank + self.qk_rope_head_dim) * H + self.kv_lora_rank
            + nh * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
            + nh * self.v_head_dim * H  # g_proj (output gate over the v heads)
            + H * nh * self.v_head_dim  # o_proj
        )
        dense = 3 * H * self.intermediate_size
        Lt, F = self.routed_expert_hidden_size, self.moe_intermediate_size
        expert = 3 * Lt * F
        moe_trunk = (
            self.num_experts * H + self.num_experts  # router + correction bias
            + Lt * H + H * Lt + (Lt if self.latent_moe_use_norm else 0)  # latent down/up + norm
            + 3 * H * self.shared_expert_intermediate_size
        )
        per_layer_common = 2 * H + 2 * (H + H)  # in/post norms + 2×(res_norm, res_proj)
        total = 2 * V * H + H + 2 * H  # embed, lm_head, final norm, output res norm/proj
        active = V * H + H + 2 * H
        for i in range(self.num_hidden_layers):
            attn = kda if self.is_kda_layer(i) else mla
            layer = per_layer_common + attn
            if self.is_moe_layer(i):
                total += layer + moe_trunk + self.num_experts * expert
                active += layer + moe_trunk + self.num_experts_per_token * expert
            else:
                total += layer + dense
                active += layer + dense
        return {"total": total, "per_routed_expert": expert, "active": active}


def getattr_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def default_full_attn_layers(num_layers: int) -> list[int]:
    """K3's MLA schedule, 1-based: every 4th layer and the last one (4, 8, …, 92, 93 for 93 layers)."""
    out = [n for n in range(4, num_layers + 1, 4)]
    if num_layers not in out:
        out.append(num_layers)
    return out


def _full() -> K3Config:
    return K3Config(quantization_config=copy.deepcopy(QUANTIZATION_CONFIG_MXFP4))


def _four_layer() -> K3Config:
    # The first four layers of full at full width: KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE.
    return _full().replace(
        num_hidden_layers=4,
        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4]},
    )


def _tiny() -> K3Config:
    # Same structure as full at CPU width: 9 layers, MLA at 1-based 4, 8, 9 (every 4th + last), AttnRes blocks
    # of 3 so three blocks close, 8 experts top-2, latent (32, one MXFP4 block) < hidden (64), one shared expert.
    return K3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=9,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        attn_res_block_size=3,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        linear_attn_config=LinearAttnConfig(
            num_heads=4,
            head_dim=16,
            short_conv_kernel_size=4,
            gate_lower_bound=-5.0,
            use_full_rank_gate=True,
            kda_layers=[1, 2, 3, 5, 6, 7],
            full_attn_layers=[4, 8, 9],
        ),
        quantization_config=copy.deepcopy(QUANTIZATION_CONFIG_MXFP4),
    )


VARIANTS = {"full": _full, "4layer": _four_layer, "tiny": _tiny}


def variant(name: str) -> K3Config:
    """The named variant: ``full`` (the release), ``4layer`` (its first four layers), ``tiny`` (CPU width).

    Variants carry the MXFP4 ``quantization_config`` of the native checkpoint; a BF16 checkpoint's config
    drops it (``cfg.replace(quantization_config=None)``).
    """
    try:
        return VARIANTS[name]()
    except KeyError:
        raise ConfigError(f"unknown variant {name!r}: expected one of {sorted(VARIANTS)}") from None


def round_up(x: int, m: int) -> int:
    return int(math.ceil(x / m) * m)
