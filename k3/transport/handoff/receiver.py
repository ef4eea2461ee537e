"""The receiving end: an engine's :class:`AdapterReceiver` (stage a version's chunks, activate it complete),
and ``serve``, its loop on a connection."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from k3.transport.handoff.buckets import digest_tensors, sync_device, unflatten
from k3.transport.handoff.wire import CLOSE, LOCAL_BUCKETS, Ack, BufferSlice, ChunkHeader, LocalBucket

ActivateFn = Callable[[int, dict[str, torch.Tensor], dict[str, Any]], None]


class AdapterReceiver:
    """The receiving end's state machine: stage chunks of one version, activate it only when complete.

    Args:
        expected: the adapter's tensors by PEFT name, as shapes (``{name: shape}``); when given, every name must
            be expected, arrive once per version with that shape, and all must arrive before activation.
        on_activate: called with ``(version, {name: tensor}, config)`` when a complete version activates (an
            engine loads the adapter here). With it, the engine owns the adapter and the receiver keeps no copy
            (``active`` stays empty); without it, ``active`` holds the last complete version.
        device: where received tensors are copied to (default: the bucket's device).
        digest: fingerprint the activated version into the last ack (costs one pass over the adapter).
    """

    records_consumed_event = True  # ``receive`` takes ``consumed`` (``serve`` passes it for a CUDA transfer buffer)

    def __init__(
        self,
        expected: Mapping[str, Sequence[int]] | None = None,
        on_activate: ActivateFn | None = None,
        device: torch.device | str | None = None,
        digest: bool = True,
    ) -> None:
        self.expected = None if expected is None else {n: tuple(s) for n, s in expected.items()}
        self.on_activate = on_activate
        self.device = None if device is None else torch.device(device)
        self.digest = digest
        self.active_version = 0
        self.active: dict[str, torch.Tensor] = {}
        self.rejected = 0
        self._staging: dict[str, torch.Tensor] | None = None
        self._staging_version = 0
        self._next_index = 0

    def receive(self, header: ChunkHeader, bucket: torch.Tensor,
                consumed: "torch.cuda.Event | None" = None) -> Ack:
        """Check one chunk against the stream, copy it out of ``bucket``, activate on the last; never raises.

        ``consumed`` (CUDA): record it behind the copy out instead of waiting for the copy, so the ack goes back
        while the copy runs; the producer's next write into ``bucket``'s memory waits on it on the device."""
        start = time.perf_counter()
        try:
            digest = self._receive(header, bucket, consumed)
        except Reject as e:
            return self.refuse(header, str(e))
        return Ack(header.version, header.index, ok=True, digest=digest, active_version=self.active_version,
                   received_at=start, receive_s=time.perf_counter() - start)

    def refuse(self, header: ChunkHeader, error: str) -> Ack:
        """Reject one chunk: the half-built version is thrown away, never activated; the active one stays."""
        self.rejected += 1
        self._staging = None
        return Ack(header.version, header.index, ok=False, error=error, active_version=self.active_version)

    def _receive(self, h: ChunkHeader, bucket: torch.Tensor, consumed: "torch.cuda.Event | None") -> str | None:
        if not isinstance(bucket, torch.Tensor):
            raise Reject(f"version {h.version} chunk {h.index} came as {type(bucket).__name__}; this receiver takes "
                          "one bucket per chunk (per-rank payloads are for an engine fed rank by rank)")
        if h.is_first:
            if h.index != 0:
                raise Reject(f"chunk marked is_first has index {h.index}")
            if h.version <= self.active_version:
                raise Reject(f"version {h.version} is not newer than the active version {self.active_version}")
            self._staging, self._staging_version, self._next_index = {}, h.version, 0
        elif self._staging is None:
            raise Reject(f"chunk {h.index} of version {h.version} arrived with no version open (is_first missing, "
                          "or the version was already rejected)")
        elif h.version != self._staging_version:
            raise Reject(f"chunk {h.index} carries version {h.version} inside version {self._staging_version}")
        if h.index != self._next_index:
            raise Reject(f"version {h.version}: chunk index {h.index}, expected {self._next_index}")
        if bucket.dim() != 1 or bucket.numel() != h.numel or bucket.dtype != h.dtype:
            raise Reject(f"version {h.version} chunk {h.index}: bucket {tuple(bucket.shape)} {bucket.dtype}, the "
                          f"header describes {h.numel} elements of {h.dtype}")
        for name, shape in zip(h.names, h.shapes, strict=True):
            if name in self._staging or h.names.count(name) > 1:
                raise Reject(f"version {h.version}: {name} delivered twice")
            if self.expected is not None:
                if name not in self.expected:
                    raise Reject(f"version {h.version}: unexpected adapter tensor {name}")
                if tuple(shape) != self.expected[name]:
                    raise Reject(f"version {h.version}: {name} has shape {tuple(shape)}, expected "
                                  f"{self.expected[name]}")
        # One copy of the whole chunk (one kernel on CUDA), cut into views: the tensors of a chunk share storage.
        flat = bucket.to(self.device or bucket.device, copy=True)
        self._staging.update(unflatten(flat, h.names, h.shapes))
        if consumed is not None:
            consumed.record(torch.cuda.current_stream(bucket.device))
        else:
            sync_device(bucket.device)  # the copy must be done before the ack lets the producer reuse the bucket
        self._next_index += 1
        if not h.is_last:
            return None
        if consumed is not None and self.on_activate is not None:
            sync_device(bucket.device)  # an engine may load the adapter on other streams or processes
        if self.expected is not None:
            missing = sorted(set(self.expected) - set(self._staging))
            if missing:
                raise Reject(f"version {h.version} ended with {len(missing)} adapter tensors missing, e.g. {missing[:3]}")
        staged, self._staging = self._staging, None
        if self.on_activate is not None:
            try:
                self.on_activate(h.version, staged, h.config)
            except Exception as e:  # noqa: BLE001 - the engine's error goes back to the trainer in the ack
                raise Reject(f"version {h.version}: loading the adapter failed: {type(e).__name__}: {e}") from e
        digest = digest_tensors(staged.items()) if self.digest else None
        self.active = {} if self.on_activate is not None else staged
        self.active_version = h.version
        return digest


class Reject(Exception):
    """A chunk this receiver refuses: its message goes back in the ack (``AdapterReceiver.refuse``)."""


class MappedBuffer:
    """The receiver's side of one ``TransferBuffer`` generation: the mapped buffer and its interprocess event."""

    def __init__(self, first: BufferSlice, event: "torch.cuda.Event | None" = None) -> None:
        buffer = first.buffer
        self.buffer = LOCAL_BUCKETS.pop(buffer.key) if isinstance(buffer, LocalBucket) else buffer
        self.generation = first.generation
        # ``event``: the one opened with an earlier generation, which still orders this one's copies
        self.event = (torch.cuda.Event.from_ipc_handle(self.buffer.device, first.event)
                      if first.event is not None else event)

    def chunk(self, s: BufferSlice) -> torch.Tensor:
        """The chunk ``s`` names, as a view of the buffer, ordered after the producer's copy into it."""
        if s.generation != self.generation or s.numel > self.buffer.numel():
            raise Reject(f"the chunk sits in transfer buffer generation {s.generation} ({s.numel} elements), but "
                          f"generation {self.generation} ({self.buffer.numel()} elements) is the one mapped here")
        if self.event is not None:
            torch.cuda.current_stream(self.buffer.device).wait_event(self.event)
        return self.buffer[:s.numel]


def serve(conn: Connection, receiver: AdapterReceiver) -> None:
    """Run ``receiver`` on ``conn`` until the producer says close (or goes away): one ack per chunk.

    Works on any ``multiprocessing`` connection — a spawned child's pipe, or a Unix socket between two
    unrelated processes such as two Ray actors (CPU buckets travel as named ``/dev/shm`` files, CUDA buckets
    as IPC handles). A fresh bucket's mapping is dropped before its ack (the producer frees it on the ack).
    The transfer buffer is mapped once per generation and kept until the next generation or the close: opening
    a CUDA IPC handle costs about as much as the copies, and the producer holds that memory for the run anyway.
    """
    mapped: MappedBuffer | None = None
    consumed: torch.cuda.Event | None = None  # recorded behind each copy out of a CUDA transfer buffer
    consumed_sent = False
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if isinstance(msg, str) and msg == CLOSE:
            return
        header, payload = msg
        del msg
        if isinstance(payload, BufferSlice):
            if payload.buffer is not None:
                event = mapped.event if mapped is not None else None
                mapped = None  # drop the old generation's mapping first: its memory can go on the producer's side
                mapped = MappedBuffer(payload, event)
                del event
            try:
                if mapped is None:
                    raise Reject(f"the chunk sits in transfer buffer generation {payload.generation}, which was "
                                  "never shared with this receiver")
                bucket = mapped.chunk(payload)
            except Reject as e:
                conn.send(receiver.refuse(header, str(e)))
                continue
        elif isinstance(payload, LocalBucket):
            bucket = LOCAL_BUCKETS.pop(payload.key)
        else:
            bucket = payload
        # Only a buffer that outlives the chunk, across processes (an IPC event came with it), skips the sync:
        # a fresh bucket is freed by the producer on the ack, a same-process one has no IPC event.
        # The receiver must say it records ``consumed`` (a receiver that hands the bucket on, as SGLang's does,
        # needs the bucket intact until it returns, so it keeps the sync).
        ordered = (isinstance(payload, BufferSlice) and mapped is not None and mapped.event is not None
                   and getattr(receiver, "records_consumed_event", False))
        if ordered and consumed is None:
            consumed = torch.cuda.Event(enable_timing=False, interprocess=True)
        del payload
        ack = receiver.receive(header, bucket, consumed) if ordered else receiver.receive(header, bucket)
        del bucket
        if ordered and not consumed_sent:
            ack, consumed_sent = replace(ack, consumed_event=consumed.ipc_handle()), True
        conn.send(ack)


def _serve(conn: Connection, make_receiver: Callable[[], AdapterReceiver]) -> None:
    """Receiver process main loop (``spawn_receiver``'s target)."""
    serve(conn, make_receiver())


def spawn_receiver(make_receiver: Callable[[], AdapterReceiver]) -> tuple[mp.Process, Connection]:
    """Start a receiver in a fresh ``spawn`` process; returns it and the producer's end of the connection.

    ``make_receiver`` runs in the child, so it must be picklable (a module-level function or a
    ``functools.partial`` of one). Close with ``AdapterProducer.close()`` then ``process.join()``.
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_serve, args=(child, make_receiver), daemon=True, name="k3-adapter-receiver")
    proc.start()
    child.close()
    return proc, parent
