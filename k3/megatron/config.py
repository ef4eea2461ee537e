"""K3TransformerConfig: megatron-core's TransformerConfig for K3, built from a ``K3Config`` and a layout.

Megatron's own fields carry what megatron's parts read (sizes, router flags, parallel sizes, dtypes); the K3
model itself, including what megatron has no field for (KDA shape, AttnRes block size, SiTU betas, the latent
width), is read from the attached ``k3`` config, so there is one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from k3.config import K3Config
from k3.megatron.recompute import Recompute
from k3.settings.parallel import ParallelLayout

__all__ = ["K3TransformerConfig", "k3_transformer_config"]


@dataclass
class K3TransformerConfig(TransformerConfig):
    """TransformerConfig plus the K3 model config it was made from."""

    k3: K3Config | None = None


def k3_transformer_config(
    cfg: K3Config,
    layout: ParallelLayout = ParallelLayout.model_parallel(),
    params_dtype: torch.dtype = torch.float32,
    dispatcher: str = "alltoall",
    use_cpu_initialization: bool = True,
    perform_initialization: bool = True,
    recompute: Recompute = Recompute(),
    **overrides,
) -> K3TransformerConfig:
    """The megatron config of K3 under ``layout``'s model-parallel sizes (TP, EP, PP, CP and the uneven pipeline
    split; a launcher layout or ``ParallelLayout.model_parallel(...)``).

    Sequence parallelism is on whenever TP > 1 (megatron's MoE requires it with TP). Under context parallelism
    the tokens are in the load-balanced layout of ``k3.megatron.context_parallel``. Routed experts are never
    tensor-parallel (ETP = 1: the shared-outer expert adapters need it). ``dispatcher`` is megatron's token
    dispatcher, ``alltoall`` (the recipe's) or ``allgather``. ``recompute``: megatron's activation recompute
    (``k3.megatron.recompute``; default off), checked against the pipeline split. ``overrides`` set any other
    TransformerConfig field.
    """
    if dispatcher not in ("alltoall", "allgather"):
        raise ValueError(f"dispatcher={dispatcher!r}: expected 'alltoall' or 'allgather'")
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype={params_dtype}: expected torch.float32 or torch.bfloat16")
    if layout.expert_tensor_parallel_size != 1:
        raise ValueError(f"expert_tensor_parallel_size={layout.expert_tensor_parallel_size}: K3 needs ETP 1")
    _check_divisible(cfg, layout)
    recompute.check_stages(_stage_layer_counts(cfg.num_hidden_layers, layout))
    L = cfg.num_hidden_layers
    moe = [1 if cfg.is_moe_layer(i) else 0 for i in range(L)]
    fields = dict(
        num_layers=L,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_attention_heads,
        kv_channels=cfg.v_head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=layout.tp > 1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        # Layers differ (KDA / MLA, dense / MoE): checkpoint keys carry global layer numbers.
        hetereogenous_dist_checkpoint=True,
        # A stage boundary carries [partial | AttnRes bank rows], wider than hidden: p2p sends shapes first.
        variable_seq_lengths=layout.pp > 1,
        k3=cfg,
    )
    fields.update(recompute.config_fields())
    if any(moe):
        fields.update(
            num_moe_experts=cfg.num_experts,
            moe_layer_freq=moe,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size or None,
            moe_router_topk=cfg.num_experts_per_token,
            moe_router_score_function="sigmoid",
            # K3Router holds the correction bias itself, frozen (mbridge's setting): megatron must not update it.
            moe_router_enable_expert_bias=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_topk_scaling_factor=cfg.routed_scaling_factor,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type=dispatcher,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
        )
    fields.update(overrides)
    return K3TransformerConfig(**fields)


def _stage_layer_counts(num_layers: int, layout: ParallelLayout) -> list[int]:
    """Layers per pipeline stage, megatron's split: even, or the given first / last stage counts and the rest
    spread evenly over the middle stages (a split that does not divide is megatron's to refuse)."""
    pp = layout.pp
    if pp == 1:
        return [num_layers]
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first is None and last is None:
        return [num_layers // pp] * pp
    middle = num_layers - (first or 0) - (last or 0)
    inner = pp - (first is not None) - (last is not None)
    each = middle // inner if inner else 0
    return ([first] if first is not None else []) + [each] * inner + ([last] if last is not None else [])


def _check_divisible(cfg: K3Config, layout: ParallelLayout) -> None:
    tp, ep = layout.tp, layout.ep
    checks = [
        ("linear_attn_config.num_heads", cfg.linear_attn_config.num_heads, tp, "TP"),
        ("num_attention_heads", cfg.num_attention_heads, tp, "TP"),
        ("intermediate_size", cfg.intermediate_size, tp, "TP"),
        ("vocab_size", cfg.vocab_size, tp, "TP"),
        ("num_experts", cfg.num_experts, ep, "EP"),
    ]  # an uneven PP split is megatron's to check (num_layers_in_first/last_pipeline_stage overrides)
    if cfg.num_shared_experts:
        checks.append(("shared expert width", cfg.shared_expert_intermediate_size, tp, "TP"))
    for name, value, n, group in checks:
        if value % n:
            raise ValueError(f"{name}={value} is not divisible by {group}={n}")
