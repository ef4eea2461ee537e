"""The SGLang engine's entry in ``k3.rollout.registry`` (cheap to import: SGLang loads in :meth:`start`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3.rollout.engine_kind import EngineKind
from k3.rollout.sglang.surface import require_sglang
from k3.settings.colocate import ColocateSettings
from k3.settings.parallel import ParallelLayout
from k3.settings.rollout import RolloutSettings

if TYPE_CHECKING:  # the worker spec's module name ends in .worker: the registry stays visibly engine-free
    from k3.settings.worker import WorkerSpec

__all__ = ["SGLangKind"]


class SGLangKind(EngineKind):
    """SGLang on the GPU cluster: one engine per ``rollout_num_gpus_per_engine`` GPUs, colocated with the
    training ranks on those GPUs. It takes its KV cache and CUDA graphs when it starts, and its scheduler
    processes outlive its Ray actor unless the engine is shut down."""

    name = "sglang"
    summary = "GPU cluster"
    needs_gpus = True
    holds_memory_at_start = True
    shutdown_with_run = True
    has_sabotage_hook = False

    def python_path(self, rollout: RolloutSettings) -> list[str]:
        return [rollout.sglang_path]

    def worker_env(self, rollout: RolloutSettings) -> dict[str, str]:
        return {
            "SGLANG_JIT_ROUTE_RADIX": "1",
            # SGLang's default NUMA membind put the whole host weight mirror on one NUMA node, which could not hold it.
            "SGLANG_NUMA_BIND_V2": os.environ.get("SGLANG_NUMA_BIND_V2", "0"),
        }

    def input_problems(self, rollout: RolloutSettings) -> list[str]:
        if (Path(rollout.sglang_path) / "sglang").is_dir() or importlib.util.find_spec("sglang") is not None:
            return []
        return [f"--sglang-path {rollout.sglang_path} has no sglang/ and sglang is not installed: install the "
                "`cluster` extra or pass --sglang-path DIR"]

    def check_available(self, rollout: RolloutSettings, *, in_process: bool) -> None:
        # Under Ray only the workers import SGLang's engine; here it is enough that the package is found.
        require_sglang(rollout.sglang_path, import_engine=in_process)

    def start(self, rollout: RolloutSettings, layout: ParallelLayout, colocate: ColocateSettings, spec: WorkerSpec,
              placement: Any | None, *, sabotage_sync: bool = False) -> list[Any]:
        if sabotage_sync:
            raise ValueError("the broken-sync test hook is the embedded engine's (has_sabotage_hook)")
        # Imported here: the engine loads torch (and, in its workers, SGLang), which the registry's importers
        # must not.
        from k3.rollout.sglang.start import start_engines

        return start_engines(rollout, layout, colocate, spec, placement)
