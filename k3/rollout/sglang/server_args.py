"""``sglang.Engine``'s keyword arguments for one rollout engine of a run (recipe §4.5, §5.1–5.2, §6.1).

:func:`build_server_args` takes the run's typed settings. :func:`settings_from_dict` is the one place a flat
mapping (a ``resolved_config.json`` read back, or plain keywords with its keys) becomes those settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from k3.settings.colocate import ColocateSettings
from k3.settings.lora import LoRAConfig, LoRAConfigError
from k3.settings.rollout import ROLLOUT_MAX_CONCURRENCY, SGLANG_PATH, RolloutSettings

__all__ = ["build_server_args", "settings_from_dict"]

# What a flat mapping may leave out: the values `k3 train` would resolve, or None where SGLang then picks its own.
# The response lengths are sampling settings the server never reads.
_DICT_DEFAULTS: dict[str, Any] = {
    "sglang_ep_size": 1, "sglang_max_mamba_cache_size": None, "sglang_cuda_graph_bs": None,
    "sglang_context_length": None, "sglang_mem_fraction_static": None, "sglang_path": SGLANG_PATH,
    "seed": None, "sglang_max_total_tokens": None, "check_weight_update_equal": False, "lora_base_cpu_backup": True,
    "eval_max_response_len": 0, "rollout_max_response_len": 0,
}


def _need(flat: Mapping[str, Any], key: str) -> Any:
    if flat.get(key) is None:
        raise ValueError(f"build_server_args: {key!r} is missing (a resolved_config.json key, e.g. from "
                         "`k3 train --dry-run`)")
    return flat[key]


def settings_from_dict(flat: Mapping[str, Any]) -> tuple[RolloutSettings, LoRAConfig, ColocateSettings]:
    """The settings :func:`build_server_args` takes, from a flat ``{name: value}`` mapping (the keys of
    ``resolved_config.json``): ``hf_checkpoint``, ``model_variant``, ``rollout_num_gpus_per_engine`` (or
    ``rollout_tp_size``), ``lora_rank`` (or ``sglang_max_lora_rank``) and ``target_modules`` are required; the
    rest default like ``k3 train`` (``rollout_max_concurrency`` 64, ``num_gpus_per_node`` 8, ``offload_rollout``
    and ``lora_base_cpu_backup`` on). Raises ``ValueError`` naming the key at fault, ``TypeError`` for a
    non-mapping."""
    if not isinstance(flat, Mapping):
        raise TypeError(f"settings_from_dict: expected a mapping (a resolved_config.json), got {type(flat).__name__}")
    model_variant = _need(flat, "model_variant")
    rank = int(flat.get("sglang_max_lora_rank") or _need(flat, "lora_rank"))
    if flat.get("experts_shared_outer_loras", True) is not True:
        raise ValueError("build_server_args: experts_shared_outer_loras must be True (K3's expert adapters share "
                         "their outer factors; SGLang serves them only in that layout)")
    try:
        lora = LoRAConfig(rank=rank, target_modules=tuple(_need(flat, "target_modules")))
    except LoRAConfigError as e:
        raise ValueError(f"build_server_args: target_modules: {e}") from None
    concurrency = int(flat.get("rollout_max_concurrency") or ROLLOUT_MAX_CONCURRENCY)
    names = {f.name for f in dataclasses.fields(RolloutSettings)}
    values = {**_DICT_DEFAULTS, **{k: v for k, v in flat.items() if k in names}}
    values.update(
        model_variant=model_variant,
        hf_checkpoint=flat.get("hf_checkpoint"),
        rollout_num_gpus_per_engine=int(flat.get("rollout_num_gpus_per_engine") or flat.get("rollout_tp_size") or 0),
        sglang_ep_size=int(values["sglang_ep_size"] or 1),
        sglang_max_lora_rank=rank,
        rollout_max_concurrency=concurrency,
        sglang_max_running_requests=int(flat.get("sglang_max_running_requests") or concurrency),
        num_gpus_per_node=int(flat.get("num_gpus_per_node") or 8),
    )
    colocate = ColocateSettings(
        colocate=bool(flat.get("colocate", True)), offload_train=bool(flat.get("offload_train", True)),
        offload_rollout=bool(flat.get("offload_rollout", True)),
        disable_weights_backuper=bool(flat.get("disable_weights_backuper", True)),
        train_memory_margin_bytes=int(flat.get("train_memory_margin_bytes") or 0))
    return RolloutSettings(**values), lora, colocate


def build_server_args(rollout: RolloutSettings, lora: LoRAConfig, colocate: ColocateSettings,
                      **overrides: Any) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments for one rollout engine of a run (recipe §4.5, §5.1–5.2, §6.1).

    ``rollout`` sizes the engine and names its checkpoint, ``lora`` the adapters it serves (its HF target names;
    the rank is ``rollout.sglang_max_lora_rank``), ``colocate`` whether it releases its memory. ``overrides``
    are applied last (a ``None`` value removes a key); an engine spanning several nodes needs
    ``dist_init_addr`` and ``node_rank`` there. Raises ``ValueError`` naming the setting at fault.
    """
    if rollout.hf_checkpoint is None:
        raise ValueError("build_server_args: 'hf_checkpoint' is missing (--hf-checkpoint: the checkpoint the "
                         "engine loads)")
    tp = rollout.rollout_num_gpus_per_engine
    if tp < 1:
        raise ValueError("build_server_args: 'rollout_num_gpus_per_engine' (the engine's TP size) must be >= 1")
    ep = rollout.sglang_ep_size
    if ep < 1 or tp % ep:
        raise ValueError(f"build_server_args: sglang_ep_size {ep} must divide the engine's TP size {tp}")
    memory_saver = colocate.offload_rollout
    cpu_backup = rollout.lora_base_cpu_backup
    if cpu_backup and not memory_saver:
        raise ValueError("build_server_args: lora_base_cpu_backup needs offload_rollout (SGLang builds the host "
                         "mirror of its base only when it releases its weights)")

    args: dict[str, Any] = {
        "model_path": str(rollout.hf_checkpoint),
        "trust_remote_code": True,
        "tp_size": tp,
        "ep_size": ep,
        "weight_version": "0",  # numeric from the start, so every sample's version parses
        # LoRA (§4.5): one adapter served at a time, HF target names, wrong names fail instead of being dropped.
        "enable_lora": True,
        "max_loras_per_batch": 1,
        "max_lora_rank": rollout.sglang_max_lora_rank,
        "lora_target_modules": lora.hf_target_modules(),
        "lora_backend": "triton",
        "lora_strict_loading": True,
        "experts_shared_outer_loras": True,
        # Above TP8 the per-rank MoE width gets tile-padded and the virtual-experts kernel rejects it.
        "lora_use_virtual_experts": tp <= 8,
        # Memory (§5.1, §5.2): release/resume need the memory saver; the CPU backup keeps the base on host.
        "enable_memory_saver": memory_saver,
        "enable_weights_cpu_backup": cpu_backup,
        "max_running_requests": int(rollout.sglang_max_running_requests),
    }
    graph_bs = rollout.sglang_cuda_graph_bs
    optional = {
        "random_seed": rollout.seed,
        "max_total_tokens": rollout.sglang_max_total_tokens,
        "max_mamba_cache_size": rollout.sglang_max_mamba_cache_size,
        "cuda_graph_bs_decode": list(graph_bs) if graph_bs else None,
        "context_length": rollout.sglang_context_length,
        "mem_fraction_static": rollout.sglang_mem_fraction_static,
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    if rollout.model_variant == "full":
        args.update(moe_runner_backend="marlin", decode_attention_backend="trtllm_mla",
                    mamba_radix_cache_strategy="extra_buffer", cuda_graph_backend_prefill="disabled")
    else:
        args.update(moe_runner_backend="triton", disable_shared_experts_fusion=True)

    gpus_per_node = rollout.num_gpus_per_node
    if gpus_per_node and tp > gpus_per_node:
        if tp % gpus_per_node:
            raise ValueError(f"build_server_args: an engine of TP {tp} cannot span whole nodes of "
                             f"{gpus_per_node} GPUs")
        args["nnodes"] = tp // gpus_per_node
        missing = [k for k in ("dist_init_addr", "node_rank") if overrides.get(k) is None]
        if missing:
            raise ValueError(f"build_server_args: an engine of TP {tp} spans {args['nnodes']} nodes of "
                             f"{gpus_per_node} GPUs: pass {' and '.join(missing)} (dist_init_addr='HOST:PORT' of "
                             f"the engine's first node, node_rank 0..{args['nnodes'] - 1})")
    for key, value in overrides.items():
        if value is None:
            args.pop(key, None)
        else:
            args[key] = value
    return args
