"""The embedded engine of a run, started: in this process, or as a Ray actor in training rank 0's bundle."""

from __future__ import annotations

from typing import Any

from k3.rollout.embedded.worker import EngineWorker
from k3.settings.rollout import RolloutSettings
from k3.settings.worker import WorkerSpec

__all__ = ["start_engine"]


def start_engine(rollout: RolloutSettings, spec: WorkerSpec, placement: Any | None, *,
                 sabotage_sync: bool = False) -> Any:
    """The run's one :class:`EngineWorker` (``rollout``: its concurrency and host backup): the object itself when
    ``placement`` is None, else its Ray actor handle, created by ``placement`` (the run's Ray placement) in the
    bundle of training rank 0."""
    args = (spec, rollout.rollout_max_concurrency, rollout.lora_base_cpu_backup, sabotage_sync)
    if placement is None:
        return EngineWorker(*args)
    import ray

    return placement.create_actor(ray.remote(EngineWorker), 0, "engine", *args)
