"""What travels between a producer and a receiver: a chunk's header, the ack, the headers of a chunk in
the transfer buffer or in this process, the close message, and the errors a send raises."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

CLOSE = "close"  # the producer's last message: the receiver stops serving


class HandoffError(RuntimeError):
    """The hand-off broke: the receiver went away, or the chunk stream was malformed."""


class HandoffRejected(HandoffError):
    """The receiver refused a chunk (wrong version, order, names or shapes); nothing of that version is active."""


class HandoffTimeout(HandoffError):
    """No ack within the timeout. The chunk's bucket is kept (the receiver may still read it) until
    ``AdapterProducer.collect`` sees the late ack."""


class ChunkLike(Protocol):
    tensors: list[tuple[str, torch.Tensor]]
    version: int
    is_first: bool
    is_last: bool
    config: dict[str, Any]


@dataclass(frozen=True)
class ChunkHeader:
    """What travels next to a bucket: how to cut it back into named tensors, and where it sits in the stream."""

    version: int
    index: int  # 0-based position of the chunk in its version
    is_first: bool
    is_last: bool
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class Ack:
    """The receiver's answer to one chunk. ``digest`` (on the last chunk) fingerprints the activated version."""

    version: int
    index: int
    ok: bool
    error: str = ""
    digest: str | None = None
    active_version: int = 0
    # When the chunk reached ``receive`` (``time.perf_counter``: CLOCK_MONOTONIC, comparable across the processes
    # of one host) and the seconds it spent there (checks, the copy out, the stream sync): where a sync's time goes.
    received_at: float = 0.0
    receive_s: float = 0.0
    # ``torch.cuda.Event.ipc_handle()`` of the receiver's "copied out of the transfer buffer" event, sent once
    # (CUDA transfer buffer only): the producer's next write into the buffer waits on it on the device.
    consumed_event: bytes | None = None


@dataclass(frozen=True)
class BufferSlice:
    """A chunk that sits in the first ``numel`` elements of the producer's ``TransferBuffer`` generation
    ``generation``. ``buffer`` (the whole buffer: a tensor that pickles as an IPC handle or a ``/dev/shm`` name,
    or a ``LocalBucket``) travels only with the first chunk of a generation, and the receiver keeps it until the
    next generation or the close; ``event`` (``torch.cuda.Event.ipc_handle()`` bytes, CUDA only) travels once per
    producer, since the buffer's event outlives its growth, and the receiver keeps it until the close."""

    generation: int
    numel: int
    buffer: Any = None
    event: bytes | None = None


@dataclass(frozen=True)
class LocalBucket:
    """A bucket handed to a receiver in the same process: a key into ``LOCAL_BUCKETS`` instead of an IPC handle."""

    key: int


# Producer-side registry of same-process buckets in flight; the receiver pops its entry before it acks, so the
# producer's ``unacked`` entry is again the only reference and ``_release`` frees the bucket as for IPC.
LOCAL_BUCKETS: dict[int, torch.Tensor] = {}
