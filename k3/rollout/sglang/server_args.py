"""``sglang.Engine``'s keyword arguments for one rollout engine of a run (recipe §4.5, §5.1–5.2, §6.1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k3.settings.lora import LoRAConfig, LoRAConfigError

__all__ = ["build_server_args", "flat_config"]


def flat_config(config: Any) -> dict[str, Any]:
    """A ``ResolvedConfig``'s flat ``{name: value}`` (its ``to_dict()``), or a mapping's copy."""
    if hasattr(config, "to_dict") and callable(config.to_dict):
        return dict(config.to_dict())
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"build_server_args: expected a ResolvedConfig or a mapping, got {type(config).__name__}")


def _need(flat: Mapping[str, Any], key: str) -> Any:
    if flat.get(key) is None:
        raise ValueError(f"build_server_args: {key!r} is missing (a resolved_config.json key, e.g. from "
                         "`k3 train --dry-run`)")
    return flat[key]


def build_server_args(config: Any, **overrides: Any) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments for one rollout engine of a run (recipe §4.5, §5.1–5.2, §6.1).

    ``config`` is a ``ResolvedConfig`` or its flat form (``resolved_config.json``; plain keyword dicts with
    the same keys work too: ``hf_checkpoint``, ``model_variant``, ``rollout_num_gpus_per_engine``,
    ``lora_rank``, ``target_modules`` are required, the rest default like ``k3 train``). ``overrides`` are
    applied last (a ``None`` value removes a key); an engine spanning several nodes needs ``dist_init_addr``
    and ``node_rank`` there. Raises ``ValueError`` naming the key at fault.
    """
    flat = flat_config(config)
    variant = _need(flat, "model_variant")
    tp = int(flat.get("rollout_num_gpus_per_engine") or flat.get("rollout_tp_size") or 0)
    if tp < 1:
        raise ValueError("build_server_args: 'rollout_num_gpus_per_engine' (the engine's TP size) must be >= 1")
    ep = int(flat.get("sglang_ep_size") or 1)
    if ep < 1 or tp % ep:
        raise ValueError(f"build_server_args: sglang_ep_size {ep} must divide the engine's TP size {tp}")
    rank = int(flat.get("sglang_max_lora_rank") or _need(flat, "lora_rank"))
    try:
        targets = LoRAConfig(rank=rank, target_modules=tuple(_need(flat, "target_modules"))).hf_target_modules()
    except LoRAConfigError as e:
        raise ValueError(f"build_server_args: target_modules: {e}") from None
    if flat.get("experts_shared_outer_loras", True) is not True:
        raise ValueError("build_server_args: experts_shared_outer_loras must be True (K3's expert adapters share "
                         "their outer factors; SGLang serves them only in that layout)")
    memory_saver = bool(flat.get("offload_rollout", True))
    cpu_backup = bool(flat.get("lora_base_cpu_backup", True))
    if cpu_backup and not memory_saver:
        raise ValueError("build_server_args: lora_base_cpu_backup needs offload_rollout (SGLang builds the host "
                         "mirror of its base only when it releases its weights)")
    concurrency = flat.get("sglang_max_running_requests") or flat.get("rollout_max_concurrency") or 64

    args: dict[str, Any] = {
        "model_path": str(_need(flat, "hf_checkpoint")),
        "trust_remote_code": True,
        "tp_size": tp,
        "ep_size": ep,
        "weight_version": "0",  # numeric from the start, so every sample's version parses
        # LoRA (§4.5): one adapter served at a time, HF target names, wrong names fail instead of being dropped.
        "enable_lora": True,
        "max_loras_per_batch": 1,
        "max_lora_rank": rank,
        "lora_target_modules": targets,
        "lora_backend": "triton",
        "lora_strict_loading": True,
        "experts_shared_outer_loras": True,
        # Above TP8 the per-rank MoE width gets tile-padded and the virtual-experts kernel rejects it.
        "lora_use_virtual_experts": tp <= 8,
        # Memory (§5.1, §5.2): release/resume need the memory saver; the CPU backup keeps the base on host.
        "enable_memory_saver": memory_saver,
        "enable_weights_cpu_backup": cpu_backup,
        "max_running_requests": int(concurrency),
    }
    optional = {
        "random_seed": flat.get("seed"),
        "max_total_tokens": flat.get("sglang_max_total_tokens"),
        "max_mamba_cache_size": flat.get("sglang_max_mamba_cache_size"),
        "cuda_graph_bs_decode": list(flat["sglang_cuda_graph_bs"]) if flat.get("sglang_cuda_graph_bs") else None,
        "context_length": flat.get("sglang_context_length"),
        "mem_fraction_static": flat.get("sglang_mem_fraction_static"),
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    if variant == "full":
        args.update(moe_runner_backend="marlin", decode_attention_backend="trtllm_mla",
                    mamba_radix_cache_strategy="extra_buffer", cuda_graph_backend_prefill="disabled")
    else:
        args.update(moe_runner_backend="triton", disable_shared_experts_fusion=True)

    gpus_per_node = int(flat.get("num_gpus_per_node") or 8)
    if tp > gpus_per_node:
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
