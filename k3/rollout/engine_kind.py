"""What the loop and the launcher know of a rollout engine, whichever it is: its name, what it needs, how it
takes and gives memory, how it is started and shut down. Each engine package (``k3.rollout.embedded``,
``k3.rollout.sglang``) defines one :class:`EngineKind` in its ``kind`` module and ``k3.rollout.registry`` lists
them, so nothing outside an engine's package branches on its name.

Cheap to import (no torch, no engine runtime): the launcher imports the registry to list the choices of
``--rollout-engine`` and to validate flags; only :meth:`EngineKind.start` imports the engine itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from k3.settings.colocate import ColocateSettings
from k3.settings.parallel import ParallelLayout
from k3.settings.rollout import RolloutSettings

if TYPE_CHECKING:  # the worker spec's module name ends in .worker: the registry stays visibly engine-free
    from k3.settings.worker import WorkerSpec

__all__ = ["EngineKind"]


class EngineKind(ABC):
    """One rollout engine as the loop and the launcher see it (see the module docstring). Each method takes
    the run's typed settings (``k3.settings``): ``rollout`` its ``RolloutSettings`` (``sglang_path``, …)."""

    name: ClassVar[str]  # the value of --rollout-engine
    summary: ClassVar[str]  # a few words for --rollout-engine's help
    needs_gpus: ClassVar[bool]  # refused on a CPU run (--num-gpus-per-node 0)
    # Takes its memory (KV cache, CUDA graphs) when it starts: it gives it up right after starting, before the
    # trainer is created, and takes it back in the recipe's startup order around the first sync (k3.rl.colocate).
    holds_memory_at_start: ClassVar[bool]
    # The loop shuts its engines down at the end of a run under Ray too: their processes do not end with the
    # engine's Ray actor. (An in-process run shuts every engine down.)
    shutdown_with_run: ClassVar[bool]
    # Implements the broken-sync test hook (K3_TEST_BREAK_ADAPTER_SYNC: every chunk acked, no version activated).
    has_sabotage_hook: ClassVar[bool]

    def python_path(self, rollout: RolloutSettings) -> list[str]:
        """Directories the run's Ray workers need on ``PYTHONPATH`` for this engine (after the repository)."""
        return []

    def worker_env(self, rollout: RolloutSettings) -> dict[str, str]:
        """Environment variables the run's Ray workers need for this engine."""
        return {}

    def input_problems(self, rollout: RolloutSettings) -> list[str]:
        """What is missing on disk for this engine (``k3 train`` lists these before anything starts, and
        ``--dry-run`` reports them), each saying what to do."""
        return []

    def check_available(self, rollout: RolloutSettings, *, in_process: bool) -> None:
        """Raise ``k3.rollout.errors.EngineUnavailableError`` (saying how to get it) when the engine cannot run
        from here; called before Ray or any model starts. ``in_process``: the engine will run in this process."""

    @abstractmethod
    def start(self, rollout: RolloutSettings, layout: ParallelLayout, colocate: ColocateSettings, spec: WorkerSpec,
              placement: Any | None, *, sabotage_sync: bool = False) -> list[Any]:
        """Start the run's engines: their worker objects when ``placement`` is None (in process), else their
        Ray actor handles (``placement`` is the run's Ray placement: ``create_actor``, ``actor_options``), in
        engine order. ``layout`` sizes and counts the engines, ``colocate`` says how they release memory,
        ``spec`` is what each worker builds its model from (the adapters it serves: ``spec.lora``);
        ``sabotage_sync`` the test hook (only where ``has_sabotage_hook``)."""
