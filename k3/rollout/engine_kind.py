"""What the loop and the launcher know of a rollout engine, whichever it is: its name, what it needs, how it
takes and gives memory, how it is started and shut down. Each engine package (``k3.rollout.embedded``,
``k3.rollout.sglang``) defines one :class:`EngineKind` in its ``kind`` module and ``k3.rollout.registry`` lists
them, so nothing outside an engine's package branches on its name.

Cheap to import (no torch, no engine runtime): the launcher imports the registry to list the choices of
``--rollout-engine`` and to validate flags; only :meth:`EngineKind.start` imports the engine itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

__all__ = ["EngineKind"]


class EngineKind(ABC):
    """One rollout engine as the loop and the launcher see it (see the module docstring).

    ``args`` below is the run's resolved flags (``ResolvedConfig.args``: ``sglang_path``, …), ``resolved`` the
    whole ``ResolvedConfig``; both are read by attribute only.
    """

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

    def python_path(self, args: Any) -> list[str]:
        """Directories the run's Ray workers need on ``PYTHONPATH`` for this engine (after the repository)."""
        return []

    def worker_env(self, args: Any) -> dict[str, str]:
        """Environment variables the run's Ray workers need for this engine."""
        return {}

    def input_problems(self, args: Any) -> list[str]:
        """What is missing on disk for this engine (``k3 train`` lists these before anything starts, and
        ``--dry-run`` reports them), each saying what to do."""
        return []

    def check_available(self, args: Any, *, in_process: bool) -> None:
        """Raise ``k3.rollout.errors.EngineUnavailableError`` (saying how to get it) when the engine cannot run
        from here; called before Ray or any model starts. ``in_process``: the engine will run in this process."""

    @abstractmethod
    def start(self, resolved: Any, spec: Any, placement: Any | None, *, sabotage_sync: bool = False) -> list[Any]:
        """Start the run's engines: their worker objects when ``placement`` is None (in process), else their
        Ray actor handles (``placement`` is the run's ``RayPlacement``), in engine order. ``spec`` is the
        run's ``k3.settings.worker.WorkerSpec``; ``sabotage_sync`` the test hook (only where
        ``has_sabotage_hook``)."""
