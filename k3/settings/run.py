"""The settings of one run as the training loop takes them: the loop's own values and every part's section.

Built once by the launcher (``k3.launch.args.resolve``) from the parsed flags; ``k3.rl.loop.run`` takes it and
hands each part its own section. Pure data: the standard library and the other ``k3.settings`` modules only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3.settings.colocate import ColocateSettings
from k3.settings.data import DataSettings
from k3.settings.lora import LoRAConfig
from k3.settings.parallel import ParallelLayout
from k3.settings.rollout import RolloutSettings
from k3.settings.train import GRPOSettings, OptimizerSettings, TrainingSettings

__all__ = ["RunSettings"]


@dataclass(frozen=True)
class RunSettings:
    """One run: where it writes (``run_dir``, ``run_id``), how long it runs (``num_rollout`` rollouts of
    ``rollout_batch_size`` prompts × ``n_samples_per_prompt`` responses, one optimizer step per
    ``global_batch_size`` samples), when it evaluates and saves (every ``eval_interval`` rollouts, None: never;
    every ``save_interval``), whether it continues the run in ``run_dir`` (``resume``), its ``seed``, its
    ``reward_model``, the ``tokenizer_path`` (the HF checkpoint), the ``rollout_engine`` (a name registered in
    ``k3.rollout.registry``) and whether it logs to W&B (``enable_wandb``); then each part's section."""

    run_dir: Path
    run_id: str
    seed: int
    resume: bool
    num_rollout: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    global_batch_size: int
    eval_interval: int | None
    save_interval: int
    reward_model: str
    tokenizer_path: str | None
    rollout_engine: str
    enable_wandb: bool
    layout: ParallelLayout
    lora: LoRAConfig
    optimizer: OptimizerSettings
    grpo: GRPOSettings
    rollout: RolloutSettings
    data: DataSettings
    colocate: ColocateSettings
    training: TrainingSettings

    @property
    def uses_gpus(self) -> bool:
        """Whether the run's ranks sit on GPUs (``--num-gpus-per-node`` > 0; 0 is a CPU run)."""
        return bool(self.rollout.num_gpus_per_node)
