"""What a worker needs to build its model: the settings the rollout engine's worker and the trainer's worker
share (one frozen value, built once by the loop from the run's settings). Pure data: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3.settings.lora import LoRAConfig
from k3.settings.parallel import ParallelLayout

__all__ = ["WorkerSpec"]


@dataclass(frozen=True)
class WorkerSpec:
    """What both roles need to build their model: the BF16 checkpoint ``model_dir``, the adapters (``lora``), the
    device and the dtype (a ``torch`` dtype's name: ``float32`` or ``bfloat16``); and the trainer's backend:
    ``torch`` (``PolicyTrainer``) or ``megatron`` (``MegatronPolicy``, base weights from the torch_dist
    ``ref_load`` when set, else ``model_dir``, on the model-parallel sizes and pipeline split of ``layout``;
    ``use_dynamic_batch_size``: packed micro-batches filled up to the trainer's token budget, the recipe's loss;
    ``recompute_*``: megatron's activation recompute, granularity None / ``full`` / ``selective``, method and layer
    count for ``full`` only).

    The trainer's guards and memory settings (``k3.settings.train``): ``use_distributed_optimizer``,
    ``optimizer_cpu_offload`` and ``optimizer_offload_fraction`` (megatron backend only: the torch backend refuses
    them set), ``check_for_nan_in_loss_and_grad`` and ``log_probs_chunk_size`` (both backends),
    ``distributed_timeout_minutes`` (the megatron backend's process groups; fractions of a minute allowed).
    ``offload_train``: the trainer sleeps while the engines generate (``k3.rl.trainers.memory_regions``; the
    engine ignores it)."""

    model_dir: str
    lora: LoRAConfig
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    backend: str = "torch"
    ref_load: str | None = None
    layout: ParallelLayout = field(default_factory=ParallelLayout.model_parallel)
    expert_lora_kernel: str = "torch"  # the trainer's routed-expert adapters: torch or triton (the engine: torch)
    transfer_buffer: bool = False  # hand chunks over through one persistent TransferBuffer, not fresh buckets
    use_dynamic_batch_size: bool = False  # megatron backend only
    recompute_granularity: str | None = None  # megatron backend only, as the three below
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # The share of the worker's GPU its CUDA allocator may reserve (ColocateSettings.gpu_memory_fraction_per_actor),
    # or the GiB of it (gpu_memory_gb_per_actor); at most one; None: no cap. Each worker applies it when it starts
    # (k3.transport.memory_cap).
    gpu_memory_fraction_per_actor: float | None = None
    gpu_memory_gb_per_actor: float | None = None
    use_distributed_optimizer: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    check_for_nan_in_loss_and_grad: bool = False
    distributed_timeout_minutes: float = 10
    log_probs_chunk_size: int = -1  # k3.settings.train.NO_LOG_PROBS_CHUNKING
    offload_train: bool = False  # the trainer's memory regions and sleep / wake_up (--offload-train)
    # The optimizer step each trainer rank runs under torch.profiler (--profile-train-step), and the folder its
    # summary goes to (the run's profile/); None: none.
    profile_train_step: int | None = None
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        if self.profile_train_step is not None and self.profile_dir is None:
            raise ValueError(f"WorkerSpec: profile_train_step={self.profile_train_step} needs profile_dir, the "
                             "folder its summary is written to")
