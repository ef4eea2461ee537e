"""What a worker needs to build its model: the settings the rollout engine's worker and the trainer's worker
share (one frozen value, built once by the loop from the run's resolved flags)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.settings.lora import LoRAConfig

__all__ = ["WorkerSpec"]


@dataclass(frozen=True)
class WorkerSpec:
    """What both roles need to build their model: the BF16 checkpoint, LoRA shape, device, dtype; and the
    trainer's backend: ``torch`` (``PolicyTrainer``) or ``megatron`` (``MegatronPolicy``, base weights from the
    torch_dist ``ref_load`` when set, else ``model_dir``; ``parallel`` = (TP, EP, PP, CP) of the layout;
    ``stage_layers`` = the layers of the first and the last pipeline stage under an uneven split, None: even;
    ``use_dynamic_batch_size``: packed micro-batches filled up to the trainer's token budget, the recipe's loss;
    ``recompute_*``: megatron's activation recompute, granularity None / ``full`` / ``selective``, method and
    layer count for ``full`` only)."""

    model_dir: str
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: tuple[str, ...]
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    backend: str = "torch"
    ref_load: str | None = None
    parallel: tuple[int, int, int, int] = (1, 1, 1, 1)
    stage_layers: tuple[int | None, int | None] = (None, None)
    expert_lora_kernel: str = "torch"  # the trainer's routed-expert adapters: torch or triton (the engine: torch)
    transfer_buffer: bool = False  # hand chunks over through one persistent TransferBuffer, not fresh buckets
    use_dynamic_batch_size: bool = False  # megatron backend only
    recompute_granularity: str | None = None  # megatron backend only, as the three below
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def lora_config(self) -> LoRAConfig:
        return LoRAConfig(rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                          target_modules=self.target_modules)

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)
