"""Test-only sabotage of the embedded engine's adapter activation, to show the run-health checks catch it.

``K3_TEST_SYNC_FAULT`` (read by ``EngineWorker`` when it starts; unset in every real run) names one fault, applied
from adapter version 2 on (the startup sync, version 1, stays healthy so the run gets going):

- ``drop_chunk:K``   chunk K never reaches the model: its tensors keep the previous version's values, and the
                     engine reports no digest for it (a silently dropped chunk);
- ``stale_chunk:K``  chunk K is applied with the previous version's tensors (a stale buffer), and reported;
- ``keep_adapter``   nothing is applied, yet the engine reports the new version and the digests of the chunks it
                     received (an adapter received but never applied: the engine keeps the previous one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SYNC_FAULT_ENV", "SyncFault", "parse_sync_fault", "sync_fault_from_env"]

SYNC_FAULT_ENV = "K3_TEST_SYNC_FAULT"
FIRST_FAULTY_VERSION = 2
_KINDS = ("drop_chunk", "stale_chunk", "keep_adapter")


@dataclass(frozen=True)
class SyncFault:
    kind: str  # one of drop_chunk | stale_chunk | keep_adapter
    chunk: int | None = None  # the chunk index of drop_chunk / stale_chunk

    def applies_to(self, version: int) -> bool:
        return version >= FIRST_FAULTY_VERSION


def parse_sync_fault(text: str) -> SyncFault:
    """``"drop_chunk:3"`` → ``SyncFault("drop_chunk", 3)``; ``ValueError`` naming the forms it accepts."""
    kind, _, arg = text.strip().partition(":")
    if kind not in _KINDS:
        raise ValueError(f"{SYNC_FAULT_ENV}={text!r}: expected drop_chunk:K, stale_chunk:K or keep_adapter")
    if kind == "keep_adapter":
        if arg:
            raise ValueError(f"{SYNC_FAULT_ENV}={text!r}: keep_adapter takes no chunk index")
        return SyncFault(kind)
    if not arg.isdigit():
        raise ValueError(f"{SYNC_FAULT_ENV}={text!r}: {kind} needs a chunk index, e.g. {kind}:0")
    return SyncFault(kind, int(arg))


def sync_fault_from_env() -> SyncFault | None:
    text = os.environ.get(SYNC_FAULT_ENV, "")
    return parse_sync_fault(text) if text else None
