"""The embedded engine's receiving end, remembering which tensors each chunk of a version brought: the engine
reports, per chunk it activated, the digest of those tensors as they are in its model after activation (the
trainer compares it with the digest of the chunk it sent: ``k3.lora.digest.chunk_digest``)."""

from __future__ import annotations

import torch

from k3.transport.handoff import Ack, AdapterReceiver, ChunkHeader

__all__ = ["ChunkRecordingReceiver"]


class ChunkRecordingReceiver(AdapterReceiver):
    """An ``AdapterReceiver`` that keeps the names of every accepted chunk of the version being received, by
    chunk index (``names``); a rejected chunk throws the version's record away with the version."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.names: dict[int, tuple[str, ...]] = {}
        self._version = 0

    def receive(self, header: ChunkHeader, bucket: torch.Tensor,
                consumed: "torch.cuda.Event | None" = None) -> Ack:
        if header.is_first or header.version != self._version:
            self.names, self._version = {}, header.version
        # Recorded before the chunk is checked: the activation callback of the last chunk reads the record.
        self.names[header.index] = tuple(header.names)
        ack = super().receive(header, bucket, consumed) if consumed is not None else super().receive(header, bucket)
        if not ack.ok:
            self.names = {}
        return ack
