"""Colocation settings: trainer and rollout engines share the devices and take turns (recipe §5).

Pure data: the standard library only. ``k3.rl.colocate`` turns these into the order of the memory hand-off.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ColocateSettings", "OFFLOAD_ROLLOUT_LEVELS", "PEAK_DEVICES"]

# Where trainer and engine copies briefly coexist at a sync (--colocate-memory-peak-device).
PEAK_DEVICES = ("cpu", "gpu")
# Engine memory released while the trainer runs (--offload-rollout-level).
OFFLOAD_ROLLOUT_LEVELS = ("kv_cache", "weight")


@dataclass(frozen=True)
class ColocateSettings:
    """How trainer and engines share the devices (recipe §5). Field names are keys of the resolved-config dump.

    ``colocate_memory_peak_device``: one of :data:`PEAK_DEVICES` (``gpu``: the other side onloads first;
    ``cpu``: each side offloads first). ``offload_rollout_level``: the engine memory released for training, a
    subset of :data:`OFFLOAD_ROLLOUT_LEVELS`. ``train_memory_margin_bytes``: bytes kept free for the trainer.
    ``gpu_memory_fraction_per_actor``: the share of its GPU each actor's CUDA allocator may reserve (every trainer
    rank and every embedded engine applies it at start); None: no cap. ``gpu_memory_gb_per_actor``: the same cap in
    GiB of the actor's device (at most one of the two is set). A per-process limit: it bounds each actor alone, not
    the sum of two actors on one device.
    """

    colocate: bool
    offload_train: bool
    offload_rollout: bool
    disable_weights_backuper: bool
    train_memory_margin_bytes: int
    colocate_memory_peak_device: str = "gpu"
    offload_rollout_level: tuple[str, ...] = OFFLOAD_ROLLOUT_LEVELS
    gpu_memory_fraction_per_actor: float | None = None
    gpu_memory_gb_per_actor: float | None = None
