"""Rollout settings: sampling, eval and what the rollout engines are started with (recipe §6.1 SGLang args,
§6.2 eval).

Pure data: the standard library only. The engine choices live in ``k3.rollout.registry`` (the engines register
there); these settings carry the chosen engine's sizes and sources.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ROLLOUT_MAX_CONCURRENCY", "SGLANG_PATH", "RolloutSettings"]

ROLLOUT_MAX_CONCURRENCY = 64  # requests an engine runs at once (--rollout-max-concurrency)
SGLANG_PATH = "/root/sglang/python"  # the recipe image's sglang source tree (--sglang-path)


@dataclass(frozen=True)
class RolloutSettings:
    """What the rollout side runs with. Field names are keys of the resolved-config dump.

    Sampling and eval: ``rollout_temperature`` … ``rollout_shuffle``, ``rollout_max_response_len`` (tokens of a
    training response), ``eval_max_response_len``, ``seed``. Each engine: ``model_variant`` and ``hf_checkpoint``
    (what it loads; None until the user names one), ``rollout_num_gpus_per_engine`` (its TP) and
    ``sglang_ep_size`` (its EP) on nodes of ``num_gpus_per_node`` GPUs (0: CPU), ``rollout_max_concurrency``
    (requests at once), ``lora_base_cpu_backup`` (a host mirror of its base while released),
    ``check_weight_update_equal`` (checksums of every received tensor). SGLang's own: ``sglang_path`` and the
    ``sglang_*`` sizes (None: SGLang's default).
    """

    eval_max_response_len: int
    rollout_num_gpus_per_engine: int
    sglang_ep_size: int
    sglang_max_running_requests: int
    sglang_max_mamba_cache_size: int | None
    sglang_cuda_graph_bs: list[int] | None
    sglang_context_length: int | None
    sglang_mem_fraction_static: float | None
    sglang_max_lora_rank: int
    model_variant: str
    hf_checkpoint: str | None
    sglang_path: str
    num_gpus_per_node: int
    seed: int | None
    rollout_max_response_len: int
    sglang_max_total_tokens: int | None
    check_weight_update_equal: bool
    lora_base_cpu_backup: bool
    rollout_max_concurrency: int = ROLLOUT_MAX_CONCURRENCY
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    eval_temperature: float = 0.0
    n_samples_per_eval_prompt: int = 1
    skip_eval_before_train: bool = False
    rollout_shuffle: bool = True
    sglang_server_concurrency: int = 16
