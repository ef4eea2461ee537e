"""The embedded engine's entry in ``k3.rollout.registry`` (cheap to import: the engine loads in :meth:`start`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k3.rollout.engine_kind import EngineKind
from k3.settings.colocate import ColocateSettings
from k3.settings.parallel import ParallelLayout
from k3.settings.rollout import RolloutSettings

if TYPE_CHECKING:  # the worker spec's module name ends in .worker: the registry stays visibly engine-free
    from k3.settings.worker import WorkerSpec

__all__ = ["EmbeddedKind"]


class EmbeddedKind(EngineKind):
    """The reference K3 generating in process, on any device: one engine per run, in training rank 0's bundle.
    Its decode cache is allocated at its first generate (nothing to give up at start), and its Ray actor takes
    everything with it."""

    name = "embedded"
    summary = "k3.model, any device"
    needs_gpus = False
    holds_memory_at_start = False
    shutdown_with_run = False
    has_sabotage_hook = True

    def start(self, rollout: RolloutSettings, layout: ParallelLayout, colocate: ColocateSettings, spec: WorkerSpec,
              placement: Any | None, *, sabotage_sync: bool = False) -> list[Any]:
        # Imported here: the engine loads torch and the model, which the registry's importers must not.
        from k3.rollout.embedded.start import start_engine

        return [start_engine(rollout, spec, placement, sabotage_sync=sabotage_sync)]
