"""The adapter hand-off's receiver for an SGLang engine: every chunk checked, then forwarded into SGLang at once.

The head worker of an engine listens on the same socket hand-off as the embedded engine
(``k3.transport.handoff.serve``); :class:`SGLangAdapterForwarder` checks every chunk with the hand-off's
``AdapterReceiver`` (version, order, names, shapes, completeness — holding shapes only, on the ``meta`` device:
SGLang holds the adapter) and forwards it at once through ``SGLangEngine.begin_adapter`` / ``AdapterLoad.add``
as one ``load_lora_adapter_from_tensors`` bucket with its first/last flags (recipe §4.5); the first chunk of a
new version unloads the old one, the last sets ``update_weight_version``. A chunk the check rejects aborts the
version: what SGLang received of it is unloaded, so a partial version is never served. The chunk is acked only
after SGLang returned, so the trainer frees its bucket only then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from k3.lora.export import AdapterChunk
from k3.rollout.errors import AdapterVersionError
from k3.transport.handoff import Ack, AdapterReceiver, unflatten

__all__ = ["SGLangAdapterForwarder"]


class SGLangAdapterForwarder:
    """``serve(conn, forwarder)``'s receiver for an SGLang engine: ``receive(header, bucket) -> Ack`` per chunk.

    ``engine``: the ``SGLangEngine``; ``expected``: ``{peft_name: shape}`` of a complete version (``chunk_layout``);
    ``run(fn, *args)``: runs ``fn`` on the engine's thread (default: here).
    """

    def __init__(self, engine: Any, expected: Mapping[str, Sequence[int]],
                 run: Callable[..., Any] | None = None) -> None:
        self.engine = engine
        # Shapes only: ``meta`` copies hold no memory, and no digest (it would need the data).
        self.checker = AdapterReceiver(expected=expected, device="meta", digest=False)
        self._run = run or (lambda fn, *args: fn(*args))
        self._load: Any | None = None
        self.forwarded = 0  # chunks SGLang accepted, over the run

    def receive(self, header: Any, bucket: torch.Tensor) -> Any:
        """Check one chunk, forward it to SGLang, ack; never raises (errors go back in the ack)."""
        ack = self.checker.receive(header, bucket)
        if not ack.ok:
            try:
                self._run(self._abort, ack.error)
            except Exception as e:  # noqa: BLE001 - the rejection is what the trainer must hear
                ack = dataclasses.replace(ack, error=f"{ack.error}; aborting the partial version failed: {e}")
            return dataclasses.replace(ack, active_version=self._active())
        try:
            self._run(self._forward, header, bucket)
        except Exception as e:  # noqa: BLE001 - the trainer gets the reason in the ack and fails the sync
            return Ack(header.version, header.index, ok=False, error=f"{type(e).__name__}: {e}",
                       active_version=self._active())
        return Ack(header.version, header.index, ok=True, active_version=self._active())

    def _active(self) -> int:
        try:
            return int(self._run(self.engine.adapter_version))
        except Exception:  # noqa: BLE001 - a shut-down engine serves nothing
            return 0

    def _forward(self, header: Any, bucket: torch.Tensor) -> None:
        if header.is_first:
            if self._load is not None and self._load.is_open:  # the checker refuses this; defensive only
                self._load.abort(RuntimeError(f"version {header.version} began before version "
                                              f"{self._load.version} ended"))
            self._load = self.engine.begin_adapter(header.version)
        if self._load is None or not self._load.is_open:
            raise RuntimeError(f"chunk {header.index} of version {header.version}: no version is being loaded")
        tensors = unflatten(bucket, header.names, header.shapes)
        if self.engine.load_mode == "whole":
            # Kept until the version's last chunk: copies, since the trainer frees (or overwrites) the bucket on
            # the ack. Streamed, SGLang's payload is built from the views (a copy) and sent before the ack.
            tensors = [(name, t.clone()) for name, t in tensors]
        chunk = AdapterChunk(tensors, header.version, header.is_first, header.is_last, config=dict(header.config))
        load = self._load
        del tensors
        load.add(chunk)
        del chunk  # streamed: no reference to the bucket may outlive the ack
        self.forwarded += 1
        if header.is_last:
            self._load = None
            load.finish()

    def _abort(self, reason: str) -> None:
        load, self._load = self._load, None
        if load is not None and load.is_open:
            load.abort(AdapterVersionError(reason))
