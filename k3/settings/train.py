"""Trainer settings: the backend, the optimizer, GRPO and what the recipe fixes per variant and mode.

Pure data: the standard library only. Field names are keys of the resolved-config dump.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BACKENDS", "EXPERT_LORA_KERNELS", "GRPOSettings", "OptimizerSettings", "TrainingSettings"]

BACKENDS = ("torch", "megatron")  # --backend
# --expert-lora-kernel. A copy of k3.kernels.expert_lora.function.KERNEL_CHOICES, which stays the source: kernels
# are leaves (they import nothing of k3, these settings included) and the settings must not load torch to read
# it. tests/unit/test_launch_args.py checks the two are equal.
EXPERT_LORA_KERNELS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer of the mode: debug_minimal = SGD (momentum 0, lr 1e-6), normal = Adam (β 0.9 / 0.98).
    ``lr``: the learning rate in effect (debug_minimal replaces --lr)."""

    optimizer: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    sgd_momentum: float
    lr_decay_style: str
    use_distributed_optimizer: bool
    optimizer_cpu_offload: bool
    optimizer_offload_fraction: float
    lr: float = 1e-5


@dataclass(frozen=True)
class GRPOSettings:
    """GRPO as the recipe runs it: group-normalised rewards, asymmetric PPO clip, no KL, no reference model."""

    advantage_estimator: str = "grpo"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    rewards_normalization: bool = True
    grpo_std_normalization: bool = True
    grpo_std_eps: float = 1e-6


@dataclass(frozen=True)
class TrainingSettings:
    """What the trainer runs with: the recipe's per-variant/mode settings (``num_steps_per_rollout`` …
    ``save``) and the trainer's flags: ``backend`` (one of :data:`BACKENDS`), ``expert_lora_kernel`` (one of
    :data:`EXPERT_LORA_KERNELS`), ``lora_transfer_buffer`` (one persistent hand-off buffer), ``ref_load`` (the
    megatron base's torch_dist checkpoint, None: from the HF checkpoint) and ``max_tokens_per_gpu`` (tokens of
    one micro-batch)."""

    num_steps_per_rollout: int
    use_dynamic_batch_size: bool
    log_probs_chunk_size: int
    recompute_granularity: str
    recompute_method: str
    recompute_num_layers: int
    check_for_nan_in_loss_and_grad: bool
    save: str
    backend: str = "torch"
    expert_lora_kernel: str = "auto"
    lora_transfer_buffer: bool = False
    ref_load: str | None = None
    max_tokens_per_gpu: int = 8192
