"""The embedded engine as a worker of the loop: the engine plus the receiving end of the adapter hand-off.

Adapter sync goes trainer → engine over a ``multiprocessing`` connection (a Unix socket the engine listens on):
the trainer's ``AdapterProducer`` sends one flattened bucket per chunk (shared memory on CPU, CUDA IPC on GPU)
and waits for the engine's ack; the engine's ``AdapterReceiver`` activates a version only when it is complete.
A plain class: the loop runs it as a Ray actor in the bundle of training rank 0, tests may run it in process.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
from collections.abc import Sequence
from multiprocessing.connection import Listener
from typing import Any

import torch

from k3.lora.digest import chunk_digest
from k3.lora.export import chunk_layout, export_chunks
from k3.rollout.embedded.chunk_record import ChunkRecordingReceiver
from k3.rollout.embedded.engine import EmbeddedEngine
from k3.rollout.embedded.sync_faults import SyncFault, sync_fault_from_env
from k3.rollout.lora_model import load_lora_model
from k3.rollout.protocol import GenerateRequest, Sample, SamplingParams
from k3.settings.worker import WorkerSpec
from k3.tokenizer import load_tokenizer
from k3.transport.device_memory import GIB, physical_bytes
from k3.transport.handoff import serve
from k3.transport.memory_cap import apply_gpu_memory_cap

__all__ = ["EngineWorker"]


class EngineWorker:
    """The embedded rollout engine plus the receiving end of the adapter hand-off.

    ``max_concurrency``: requests per generation pass (``--rollout-max-concurrency``); ``cpu_backup``: keep the
    base on host while the weights are released (``--lora-base-cpu-backup``); ``sabotage_sync``: the test hook of a
    broken adapter sync (every chunk is acked, no version is ever activated: the engine keeps serving version 0).
    ``K3_TEST_SYNC_FAULT`` (test-only, ``k3.rollout.embedded.sync_faults``) plants a subtler fault.

    After every activation the worker digests, per chunk it received, those tensors as its model now holds them
    (``adapter_report``): what the trainer's ``chunk_digests`` of the same sync must equal.
    """

    def __init__(self, spec: WorkerSpec, max_concurrency: int, cpu_backup: bool = True,
                 sabotage_sync: bool = False) -> None:
        self.spec = spec
        # Before the model loads: every allocation of the engine counts against the cap.
        capped = apply_gpu_memory_cap(spec.device, "embedded engine", fraction=spec.gpu_memory_fraction_per_actor,
                                      gb=spec.gpu_memory_gb_per_actor)
        if capped:
            print(capped, flush=True)
        self.tokenizer = load_tokenizer(spec.model_dir)
        self.engine = EmbeddedEngine(load_lora_model(spec), self.tokenizer, max_concurrency=max_concurrency,
                                     device=spec.device, cpu_backup=cpu_backup)
        self._sabotage_sync = sabotage_sync
        self._listener: Listener | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._fault: SyncFault | None = sync_fault_from_env()
        self._report: dict[str, Any] = {"version": 0, "chunk_digests": {}}

    # -- hand-off
    def listen(self) -> tuple[str, bytes]:
        """Open the adapter socket; returns ``(address, authkey)`` for the trainer's ``TrainerWorker.connect``."""
        layout = chunk_layout(self.engine.model.config, self.spec.lora)
        expected = {name: shape for c in layout for name, shape in c.tensors}
        path = os.path.join(tempfile.mkdtemp(prefix="k3-sync-"), "adapter.sock")
        authkey = secrets.token_bytes(16)
        self._listener = Listener(path, family="AF_UNIX", authkey=authkey)

        def activate(version: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
            if self._sabotage_sync:
                return
            self._activate(version, tensors, dict(receiver.names))

        receiver = ChunkRecordingReceiver(expected=expected, on_activate=activate, device=self.spec.device,
                                          digest=False)

        def run() -> None:
            try:
                conn = self._listener.accept()
                serve(conn, receiver)
            except Exception as e:  # noqa: BLE001 - surfaced through error()
                self._error = f"{type(e).__name__}: {e}"

        self._thread = threading.Thread(target=run, name="k3-adapter-receiver", daemon=True)
        self._thread.start()
        return path, authkey

    def error(self) -> str | None:
        return self._error

    def _active_tensors(self) -> dict[str, torch.Tensor]:
        """The model's adapter tensors by PEFT name, as the trainer exports them (BF16)."""
        return {name: t for chunk in export_chunks(self.engine.model, self.engine.adapter_version())
                for name, t in chunk.tensors}

    def _activate(self, version: int, tensors: dict[str, torch.Tensor], names: dict[int, tuple[str, ...]]) -> None:
        """Activate ``version`` and record, per received chunk, the digest of its tensors as the model now holds
        them (a planted ``K3_TEST_SYNC_FAULT`` bends this; see ``k3.rollout.embedded.sync_faults``)."""
        fault = self._fault if self._fault is not None and self._fault.applies_to(version) else None
        reported = dict(names)
        applied = tensors
        if fault is not None:
            previous = self._active_tensors()
            if fault.kind == "keep_adapter":
                applied = {name: previous[name] for name in tensors}
            else:
                if fault.chunk not in names:
                    raise ValueError(f"{fault.kind}:{fault.chunk}: version {version} has chunks 0..{len(names) - 1}")
                applied = dict(tensors) | {name: previous[name] for name in names[fault.chunk]}
                if fault.kind == "drop_chunk":
                    del reported[fault.chunk]
        self.engine.activate(version, applied)
        # keep_adapter lies: it reports what it received, not what its model holds
        held = tensors if fault is not None and fault.kind == "keep_adapter" else self._active_tensors()
        self._report = {"version": version,
                        "chunk_digests": {i: chunk_digest([(n, held[n]) for n in ns]) for i, ns in sorted(reported.items())}}

    def adapter_report(self) -> dict[str, Any]:
        """What the engine says it activated: ``{"version": V, "chunk_digests": {chunk index: digest}}`` — the
        ``k3.lora.digest.chunk_digest`` of each chunk of version V it received, over those tensors as its model
        holds them after activation (a chunk it never received has no entry)."""
        return {"version": self.engine.adapter_version(), "chunk_digests": dict(self._report["chunk_digests"])}

    # -- protocol passthrough
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        return self.engine.generate(requests, sampling)

    def adapter_version(self) -> int:
        return self.engine.adapter_version()

    def release_memory(self, tags: Sequence[str]) -> None:
        self.engine.release_memory(tags)

    def resume_memory(self, tags: Sequence[str]) -> None:
        self.engine.resume_memory(tags)

    def memory_reading(self) -> dict[str, Any]:
        """This engine's memory now, for the loop's ``memory`` events around a release or resume:
        ``memory/physical_gb`` (CUDA: the device's total − free, every process on it; CPU: this process's RSS)
        and ``memory/engine_weights_resident``."""
        return {"device": self.spec.device, "memory/physical_gb": physical_bytes(self.spec.device) / GIB,
                "memory/engine_weights_resident": "weights" not in self.engine.released_tags()}

    # The loop brackets every sync with these on every engine (recipe §5.4 steps 6-7). The embedded engine
    # generates only inside generate(), so nothing runs that could be paused: both are no-ops.
    def pause_generation(self) -> None:
        pass

    def continue_generation(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
        self.engine.shutdown()
