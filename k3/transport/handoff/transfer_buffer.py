"""The persistent transfer buffer: one flat bucket per device that every chunk is copied into."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.transport.handoff.buckets import resolved_device


class TransferBuffer:
    """One persistent flat bucket per device that chunks are copied into, growing when a chunk is larger.

    Reusing one allocation means the buffer is shared with the receiver once per allocation (a *generation*),
    not once per chunk: after that a chunk travels as a ``BufferSlice`` header naming the generation and its
    length, and the receiver reads it from the mapping it holds. Fresh buckets instead rotate IPC handles and
    ref-counter files per chunk and race the consumer's release. The public recipe capped its buffer at 512 MiB
    and asserted, which fails at rank >= 33 with expert down-projection adapters; here it grows to
    ``max(needed, 2 x old)`` elements, and a grown buffer is a new generation that is shared again.

    Ordering on CUDA, with no host sync on either side: ``stage`` enqueues the copy and records ``event``
    (interprocess) behind it; the receiver makes its stream wait on that event, enqueues its copy out, records
    its own interprocess event (``consumed``, its handle sent back once in an ack) behind that copy and acks at
    once. Every later write into the buffer (``claim``: ``stage`` and the exporter's in-place writes) first makes
    the producer's stream wait on ``consumed``, so the ack's way back overlaps the copies instead of following
    them. torch's own IPC event cannot serve here: it is recorded only when a storage is first shared, and the
    receiver skips it when the mapping is cached. Freeing the buffer (growth, ``release``) waits for ``consumed``
    on the host: the allocator may hand the memory to any stream after that. Without a ``consumed`` event (the
    CPU, a receiver in this process, or an older receiver) the receiver finishes its copy before it acks.

    ``capacity`` is in elements of ``dtype``; ``grows`` counts reallocations after the first.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, initial_numel: int = 0) -> None:
        self.device = resolved_device(device)
        self.dtype = dtype
        self.grows = 0
        self.generation = 0  # bumped by every allocation: the receiver must map each generation once
        self._buffer: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._consumed: torch.cuda.Event | None = None  # the receiver's copy-out event, opened from its handle
        if initial_numel > 0:
            self._allocate(initial_numel)

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def buffer(self) -> torch.Tensor | None:
        """The whole current buffer (what a new generation shares), or None before the first chunk."""
        return self._buffer

    @property
    def event(self) -> "torch.cuda.Event | None":
        """The interprocess event recorded behind every staged copy (CUDA only; created at the first stage)."""
        return self._event

    def set_consumed_event(self, handle: bytes) -> None:
        """Open the receiver's copy-out event (``Ack.consumed_event``); later writes wait on it on the device."""
        self._consumed = torch.cuda.Event.from_ipc_handle(self.device, handle)

    def wait_consumed(self) -> None:
        """Block the host until the receiver's last copy out of the buffer has finished (no-op without one)."""
        if self._consumed is not None:
            self._consumed.synchronize()

    def _allocate(self, numel: int) -> None:
        if self._buffer is not None:
            self.grows += 1
            self.wait_consumed()  # the receiver may still be reading the old buffer
        self._buffer = None  # drop the old one first: the peak is then the new buffer, not both
        buf = torch.empty(numel, dtype=self.dtype, device=self.device)
        if buf.device.type == "cpu":
            buf.share_memory_()
        self._buffer = buf
        self.generation += 1

    def claim(self, numel: int) -> torch.Tensor:
        """The buffer's first ``numel`` elements (growing it first if it is smaller), to be written by the caller;
        call ``mark_written`` after the writes are enqueued."""
        if numel > self.capacity:
            self._allocate(max(numel, 2 * self.capacity))
        if self._consumed is not None:  # the receiver's copy of the previous chunk comes first
            torch.cuda.current_stream(self.device).wait_event(self._consumed)
        return self._buffer[:numel]

    def mark_written(self) -> None:
        """On CUDA, record ``event`` behind the writes enqueued so far on the current stream (no host sync)."""
        if self.device.type == "cuda":
            if self._event is None:
                self._event = torch.cuda.Event(enable_timing=False, interprocess=True)
            self._event.record(torch.cuda.current_stream(self.device))

    def stage(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy ``tensors`` (all of ``dtype``) into the buffer; returns the filled prefix.

        On CUDA the copy is only enqueued: ``event`` marks its end for the receiver's stream."""
        prefix = self.claim(sum(t.numel() for t in tensors))
        torch.cat([t.reshape(-1) for t in tensors], out=prefix)
        self.mark_written()
        return prefix

    def release(self) -> None:
        """Free the buffer (after the last sync of a run), once the receiver's last copy out has finished."""
        if self._buffer is not None:
            self.wait_consumed()
        self._buffer = None
