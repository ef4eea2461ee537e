"""Trainer settings: the backend, the optimizer, GRPO and what the recipe fixes per variant and mode.

Pure data: the standard library only. Field names are keys of the resolved-config dump.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BACKENDS", "EXPERT_LORA_KERNELS", "HYPERPARAMETERS", "NO_LOG_PROBS_CHUNKING", "OPTIMIZERS",
           "GRPOSettings", "OptimizerSettings", "TrainingSettings", "check_log_probs_chunk_size",
           "keep_hyperparameters", "optimizer_kind_problem", "optimizer_options_problem", "restore_hyperparameters"]

BACKENDS = ("torch", "megatron")  # --backend
# --expert-lora-kernel. A copy of k3.kernels.expert_lora.function.KERNEL_CHOICES, which stays the source: kernels
# are leaves (they import nothing of k3, these settings included) and the settings must not load torch to read
# it. tests/unit/test_launch_args.py checks the two are equal.
EXPERT_LORA_KERNELS = ("auto", "torch", "triton")
# log_probs_chunk_size: the recipe's (miles') --log-probs-chunk-size, whose default -1 means one pass over all tokens.
NO_LOG_PROBS_CHUNKING = -1
# The optimizers both trainers build: the recipe's normal mode runs Adam (decoupled weight decay), debug_minimal SGD.
OPTIMIZERS = ("adam", "sgd")


def check_log_probs_chunk_size(value: int) -> int:
    """``value`` when it is a valid ``log_probs_chunk_size``: tokens per log-softmax chunk (>= 1), or
    :data:`NO_LOG_PROBS_CHUNKING`; else ``ValueError`` naming it (0 too: miles reads it as "no chunking", which
    -1 already says)."""
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or value == NO_LOG_PROBS_CHUNKING):
        raise ValueError(f"log_probs_chunk_size={value!r}: expected tokens per chunk (an integer >= 1), or "
                         f"{NO_LOG_PROBS_CHUNKING} for no chunking")
    return value


def optimizer_options_problem(use_distributed_optimizer: bool, optimizer_cpu_offload: bool,
                              optimizer_offload_fraction: float, optimizer: str = "adam",
                              sgd_momentum: float = 0.0) -> str | None:
    """What keeps the trainers from running these optimizer options (one line), or None: ``optimizer`` one of
    :data:`OPTIMIZERS`, ``sgd_momentum`` in [0, 1), the offload fraction in [0, 1], no fraction without the offload,
    the offload (megatron-core 0.16.1's) only under the distributed optimizer and only with Adam. The device is
    checked where the optimizer is built (``k3.megatron.optimizer``): the offload also needs CUDA."""
    if optimizer not in OPTIMIZERS:
        return f"optimizer={optimizer!r}: expected one of {', '.join(OPTIMIZERS)}"
    m = sgd_momentum
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:  # NaN fails the range too
        return f"sgd_momentum={m!r}: expected a momentum factor in [0, 1)"
    f = optimizer_offload_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
        return f"optimizer_offload_fraction={f!r}: expected a fraction in [0, 1]"
    if f > 0 and not optimizer_cpu_offload:
        return (f"optimizer_offload_fraction={f:g} without optimizer_cpu_offload: nothing would be offloaded; set the "
                "fraction to 0 or turn the offload on")
    if optimizer_cpu_offload and not use_distributed_optimizer:
        return ("optimizer_cpu_offload needs use_distributed_optimizer: megatron-core's hybrid CPU/GPU optimizer is "
                "run under the distributed optimizer (the pairing Megatron-LM validates)")
    if optimizer_cpu_offload and optimizer != "adam":
        return (f"optimizer_cpu_offload with optimizer={optimizer!r}: the offload is wired (and its state saved for "
                "a resume) for Adam only, the recipe's normal mode; SGD at momentum 0 holds no state to offload")
    return None


def optimizer_kind_problem(saved: str, have: str) -> str | None:
    """Why an optimizer state saved by the ``saved`` optimizer (one of :data:`OPTIMIZERS`) cannot resume a run of
    ``have`` (one line), or None when they are the same: Adam's moments mean nothing to SGD, and a resume must not
    run on with another optimizer's hyperparameters."""
    if saved == have:
        return None
    return (f"the optimizer state was saved by {saved}; this run trains with {have}: resume in the --mode that "
            "saved it (debug_minimal: sgd, normal: adam), or start a new run")


# The hyperparameters an optimizer's param group holds that the run's settings set (torch's Adam/AdamW and SGD
# names, which megatron's optimizers carry too).
HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov")


def keep_hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's hyperparameters of each param group (those of :data:`HYPERPARAMETERS` it holds), to put back after
    an optimizer state is loaded: torch's ``load_state_dict`` (and megatron's, which calls it) replaces them with
    the saving run's, so a resume would run on with that run's lr, momentum or betas instead of the printed ones."""
    return [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in param_groups]


def restore_hyperparameters(param_groups: list[dict[str, Any]], kept: list[dict[str, Any]]) -> None:
    """Put :func:`keep_hyperparameters` output back into ``param_groups`` (the same groups, in the same order)."""
    if len(kept) != len(param_groups):
        raise ValueError(f"the optimizer has {len(param_groups)} param groups after the load, {len(kept)} before")
    for group, values in zip(param_groups, kept):
        group.update(values)


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer of the mode: debug_minimal = SGD (``sgd_momentum`` 0, lr 1e-6), normal = Adam (β 0.9 /
    0.98); ``optimizer`` one of :data:`OPTIMIZERS`, built by both trainers; ``adam_beta1`` / ``adam_beta2`` apply
    to Adam only, ``sgd_momentum`` to SGD only. ``lr``: the learning rate in effect (debug_minimal replaces --lr).
    ``use_distributed_optimizer``: megatron's distributed optimizer (the optimizer state and fp32 main weights
    sharded over data-parallel ranks); ``optimizer_cpu_offload`` / ``optimizer_offload_fraction``: that fraction
    of it on the host (needs the distributed optimizer, Adam and CUDA); the megatron backend applies the three,
    the torch backend (one rank) none: it needs them False / 0."""

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

    def __post_init__(self) -> None:
        problem = optimizer_options_problem(self.use_distributed_optimizer, self.optimizer_cpu_offload,
                                            self.optimizer_offload_fraction, self.optimizer, self.sgd_momentum)
        if problem is not None:
            raise ValueError(problem)


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
    one micro-batch).

    ``log_probs_chunk_size``: tokens per chunk of the log-softmax over the vocabulary in the log-prob pass and the
    train step (both backends; :data:`NO_LOG_PROBS_CHUNKING`: one pass); ``check_for_nan_in_loss_and_grad``: a NaN
    or Inf in a loss or a rank's gradients stops the run naming the rank and the optimizer step (both backends);
    ``distributed_timeout_minutes``: the timeout of every collective of the trainer's process groups (megatron;
    the torch backend has none). ``profile_train_step``: the optimizer step (0 = the run's first) each trainer
    rank runs under ``torch.profiler`` and summarises into the run's ``profile/`` folder (``k3.rl.step_profile``);
    on CUDA the step after it also records what it leaves allocated there (``k3.rl.step_memory``); None: none."""

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
    distributed_timeout_minutes: int = 10
    profile_train_step: int | None = None

    def __post_init__(self) -> None:
        check_log_probs_chunk_size(self.log_probs_chunk_size)
        step = self.profile_train_step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"profile_train_step={step!r}: expected an optimizer step index >= 0, or None")
        if isinstance(self.distributed_timeout_minutes, bool) or not isinstance(self.distributed_timeout_minutes, int) \
                or self.distributed_timeout_minutes < 1:
            raise ValueError(f"distributed_timeout_minutes={self.distributed_timeout_minutes!r}: expected whole "
                             "minutes >= 1")
