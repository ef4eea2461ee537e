"""Adapter hand-off between processes: one flattened bucket per chunk, an ack per chunk, versioned activation.

The producer (a trainer rank) flattens each adapter chunk into one 1-D bucket and sends it with
``torch.multiprocessing``'s reductions over a ``multiprocessing`` connection: a CUDA bucket travels as a CUDA
IPC handle, a CPU bucket as a shared-memory segment — the same code path. The receiver (an engine) copies
the chunk out of the bucket, drops its reference, and only then acks, so:

* the producer keeps the bucket alive until the ack (and, with several producers feeding one engine, until
  every producer has crossed ``barrier``; an engine fed rank by rank: ``k3.transport.fed_producer``), then
  releases it and, on CUDA, runs ``torch.cuda.ipc_collect()``;
* a persistent ``TransferBuffer`` can be overwritten by the next chunk as soon as the ack arrives. It is shared
  once per allocation; its chunks then travel as small ``BufferSlice`` headers, ordered on CUDA by an
  interprocess event instead of a host sync.

Exporting in place: an exporter that asks ``AdapterProducer.bucket_for`` where the next chunk goes and writes its
tensors there (consecutive views, in order; ``export_chunks(..., out=producer.bucket_for)``) saves the staging
copy: the chunk is already its bucket (or sits in the transfer buffer). Any other chunk is copied in as before.

Versioning: chunks of a version arrive in order (``is_first`` ... ``is_last``); the receiver rejects a chunk
whose version, index or names do not fit the stream, discards the half-built version, and activates a
version only after its last chunk arrived complete. A rejection comes back as ``HandoffRejected``.

CPU sharing strategy: ``file_system``. Under torch's default ``file_descriptor`` strategy a segment is
unlinked from ``/dev/shm`` the moment it is created and travels as a file descriptor, so a leaked bucket is
invisible there (it shows only as mapped memory and open fds). Under ``file_system`` every shared storage
is a named ``/dev/shm/torch_<pid>_*`` file that exists exactly as long as some process holds the storage,
which makes "no segment left from this sync" a direct observation (``k3.transport.leakcheck``); it also
uses no file descriptor per chunk. Torch allows one strategy per process, so the producer sets it
process-wide; segments of a crashed process are reaped by torch's ``torch_shm_manager``.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

__all__ = [
    "ChunkHeader", "Ack", "TransferBuffer", "BufferSlice", "LocalBucket", "AdapterProducer", "AdapterReceiver",
    "spawn_receiver", "serve",
    "flatten_into", "flat_views", "unflatten", "resolved_device", "digest_tensors", "use_file_system_sharing",
    "HandoffError", "HandoffRejected", "HandoffTimeout",
]

_CLOSE = "close"


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


def use_file_system_sharing() -> None:
    """Switch this process's CPU tensor sharing to ``file_system`` (see the module docstring for why)."""
    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def flatten_into(bucket: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` back to back into the 1-D ``bucket``; returns the filled prefix (a view)."""
    numel = sum(t.numel() for t in tensors)
    if numel > bucket.numel():
        raise ValueError(f"bucket holds {bucket.numel()} elements, the chunk needs {numel}")
    prefix = bucket[:numel]
    torch.cat([t.reshape(-1) for t in tensors], out=prefix)
    return prefix


def flat_views(flat: torch.Tensor, shapes: Iterable[Sequence[int]]) -> list[torch.Tensor]:
    """Consecutive views of the 1-D ``flat`` with ``shapes``, in order (``flat`` must hold exactly their sum): the
    bucket layout, for a chunk written into its bucket (``export_chunks(..., out=)``) or read out of it."""
    views, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[at:at + n].view(*shape))
        at += n
    if at != flat.numel():
        raise ValueError(f"the chunk's tensors need {at} elements, its destination has {flat.numel()}")
    return views


def unflatten(bucket: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """``flat_views`` of ``bucket`` named by a received header (inverse of ``flatten_into``)."""
    need = sum(math.prod(shape) for shape in shapes)
    if need != bucket.numel():
        raise ValueError(f"bucket has {bucket.numel()} elements, the header's shapes need {need}")
    return list(zip(names, flat_views(bucket, shapes), strict=True))


def resolved_device(device: torch.device | str) -> torch.device:
    """``device`` with the current CUDA device's index where it names none: tensors report ``cuda:N``, and a bare
    ``cuda`` must compare equal to theirs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in name order: equal iff the adapters are bit-identical."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


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


class AdapterProducer:
    """The sending end of one connection to a receiver.

    Args:
        conn: a ``multiprocessing`` connection to the receiver (see ``spawn_receiver``); None only for a producer
            that sends through another rank (``k3.transport.fed_producer``).
        transfer_buffer: copy every chunk into this persistent buffer instead of a fresh bucket per chunk.
        ack_timeout_s: how long to wait for each ack (seconds).
        barrier: called after each ack and before the bucket is released; with several producers feeding one
            engine, a barrier across them (the recipe releases only after every producer got its ack).
        on_bucket: called with every fresh bucket before it is sent (a leak gate tracks it; the persistent
            transfer buffer is meant to stay, so it is not reported).
        same_process: the receiver runs in this process (``k3 train`` without Ray). CUDA cannot open an IPC
            handle in the process that exported it, so buckets then travel as ``LocalBucket`` tokens that the
            receiver resolves from this process's registry (zero-copy); the ack protocol is unchanged.
    """

    def __init__(
        self,
        conn: Connection | None,
        transfer_buffer: TransferBuffer | None = None,
        ack_timeout_s: float = 60.0,
        barrier: Callable[[], None] | None = None,
        on_bucket: Callable[[torch.Tensor], None] | None = None,
        same_process: bool = False,
    ) -> None:
        if ack_timeout_s <= 0:
            raise ValueError(f"ack_timeout_s={ack_timeout_s}: expected > 0")
        self.conn = conn
        self.transfer_buffer = transfer_buffer
        self.ack_timeout_s = ack_timeout_s
        self.barrier = barrier
        self.on_bucket = on_bucket
        self.same_process = same_process
        # Buckets sent but not acked, by (version, index): the receiver may still be reading them.
        self.unacked: dict[tuple[int, int], torch.Tensor] = {}
        self._shared_generation = 0  # the transfer buffer generation the receiver has mapped (0: none)
        self._shared_event = False  # whether the receiver has the transfer buffer's interprocess event
        self._handed_out: torch.Tensor | None = None  # the last ``bucket_for`` destination, not yet sent
        self._closed = False
        use_file_system_sharing()

    # ------------------------------------------------------------------ one chunk
    def bucket_for(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Where to write the next chunk to export it in place: a 1-D ``[numel]`` tensor.

        A chunk whose tensors are then consecutive contiguous views of it, in order and covering it, is sent
        without the staging copy (``send_chunk``); any other chunk is copied in as usual. With a transfer buffer
        this is the buffer's prefix (so the chunk sent before must have been acked), else a fresh bucket, in shared
        memory on the CPU. Only the latest destination counts.
        """
        if self._closed:
            raise HandoffError("producer is closed")
        device = resolved_device(device)
        self._handed_out = None
        if self.transfer_buffer is None:
            out = torch.empty(numel, dtype=dtype, device=device)
            if out.device.type == "cpu":
                out.share_memory_()
        else:
            self._check_buffer_free()
            if self.transfer_buffer.dtype != dtype or self.transfer_buffer.device != device:
                raise HandoffError(f"bucket_for: {dtype} on {device} does not fit the transfer buffer "
                                   f"({self.transfer_buffer.dtype} on {self.transfer_buffer.device})")
            out = self.transfer_buffer.claim(numel)
        self._handed_out = out
        return out

    def _check_buffer_free(self) -> None:
        if self.unacked:
            self.collect()
        if self.unacked:
            raise HandoffError(f"chunks {sorted(self.unacked)} were never acked; the transfer buffer they sit "
                               "in cannot be overwritten")

    def _exported_in_place(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The ``bucket_for`` destination if ``tensors`` are its consecutive views, in order, covering it."""
        dest, self._handed_out = self._handed_out, None
        if dest is None:
            return None
        at, size = dest.data_ptr(), dest.element_size()
        for t in tensors:
            if t.dtype != dest.dtype or t.device != dest.device or not t.is_contiguous() or t.data_ptr() != at:
                return None
            at += t.numel() * size
        return dest if at == dest.data_ptr() + dest.numel() * size else None

    def send_chunk(self, chunk: ChunkLike, index: int) -> Ack:
        """Send one chunk as chunk ``index`` of its version and wait for the ack; returns it.

        Raises ``HandoffRejected`` if the receiver refused it, ``HandoffTimeout`` without an ack in time.
        """
        if self._closed:
            raise HandoffError("producer is closed")
        if self.conn is None:
            raise HandoffError("this producer has no connection to a receiver: it sends through its feed's source")
        if self.transfer_buffer is not None:
            self._check_buffer_free()
        elif self.unacked:
            self.collect()
        header, tensors = self._header_of(chunk, index)
        del chunk  # a chunk exported in place is views of its bucket: no frame of a failed send may keep it
        bucket = self._bucket_of(tensors, header, index)
        if self.same_process:
            _sync_device(bucket.device)  # no IPC event between two threads of one process: finish the copy here
        del tensors  # the chunk's own tensors can go as soon as the bucket holds them
        key = (header.version, index)
        self.unacked[key] = bucket
        if self.transfer_buffer is not None:
            payload = (header, self._buffer_slice(bucket.numel()))
        elif self.same_process:
            payload = (header, self._local_token(bucket))
        else:
            payload = (header, bucket)
        del bucket  # only ``unacked`` may keep it: a traceback holding it would pin the segment
        try:
            self.conn.send(payload)
        except (BrokenPipeError, EOFError, OSError) as e:
            raise HandoffError(f"receiver connection broke while sending chunk {index} of version "
                               f"{header.version}: {e}") from e
        finally:
            del payload
        ack = self._wait_ack(key)
        if ack.consumed_event is not None and self.transfer_buffer is not None:
            self.transfer_buffer.set_consumed_event(ack.consumed_event)
        if self.barrier is not None:
            self.barrier()
        self._release(key)
        if not ack.ok:
            raise HandoffRejected(f"receiver rejected chunk {index} of version {header.version}: {ack.error}")
        return ack

    @staticmethod
    def _header_of(chunk: ChunkLike, index: int) -> tuple[ChunkHeader, list[torch.Tensor]]:
        """The header of ``chunk`` as chunk ``index`` of its version, and its tensors in order."""
        names = tuple(n for n, _ in chunk.tensors)
        tensors = [t for _, t in chunk.tensors]
        if not tensors:
            raise HandoffError(f"chunk {index} of version {chunk.version} has no tensors")
        dtypes = {t.dtype for t in tensors}
        devices = {t.device for t in tensors}
        if len(dtypes) != 1 or len(devices) != 1:
            raise HandoffError(f"chunk {index} mixes dtypes {dtypes} / devices {devices}: one bucket needs one of each")
        header = ChunkHeader(
            version=chunk.version, index=index, is_first=chunk.is_first, is_last=chunk.is_last, names=names,
            shapes=tuple(tuple(t.shape) for t in tensors), dtype=tensors[0].dtype, config=dict(chunk.config),
        )
        return header, tensors

    def _bucket_of(self, tensors: list[torch.Tensor], header: ChunkHeader, index: int) -> torch.Tensor:
        """The bucket that carries the chunk: the ``bucket_for`` destination it was exported into, else a copy of
        its tensors in the transfer buffer or in a fresh bucket (in shared memory on the CPU)."""
        in_place = self._exported_in_place(tensors)
        tb = self.transfer_buffer
        if tb is not None:
            if tb.dtype != header.dtype or tb.device != tensors[0].device:
                raise HandoffError(f"chunk {index}: {header.dtype} on {tensors[0].device} does not fit the transfer "
                                   f"buffer ({tb.dtype} on {tb.device})")
            if in_place is not None:
                tb.mark_written()  # behind the exporter's writes
                return in_place
            held = None if tb.buffer is None else tb.buffer.untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() == held for t in tensors):
                tensors = [t.clone() for t in tensors]  # written into the buffer, but not as its prefix in order
            return tb.stage(tensors)
        bucket = in_place
        if bucket is None:
            bucket = torch.empty(header.numel, dtype=header.dtype, device=tensors[0].device)
            if bucket.device.type == "cpu":
                bucket.share_memory_()  # allocate in shm directly: pickling would otherwise move (copy) it there
            flatten_into(bucket, tensors)
        # No host sync across processes: sharing a fresh CUDA storage records torch's IPC event behind the writes,
        # and the receiver's stream waits on it when it opens the handle.
        if self.on_bucket is not None:
            self.on_bucket(bucket)
        return bucket

    def _local_token(self, tensor: torch.Tensor) -> "LocalBucket":
        token = LocalBucket(id(tensor))
        _LOCAL_BUCKETS[token.key] = tensor
        return token

    def _buffer_slice(self, numel: int) -> "BufferSlice":
        """The header of a chunk staged in the transfer buffer; the buffer (and its event) ride along only the
        first time the receiver sees this generation."""
        tb = self.transfer_buffer
        if self._shared_generation == tb.generation:
            return BufferSlice(tb.generation, numel)
        self._shared_generation = tb.generation
        if self.same_process:
            return BufferSlice(tb.generation, numel, buffer=self._local_token(tb.buffer))
        # The event outlives a grown buffer: its handle goes once, and the receiver keeps what it opened.
        event = None
        if tb.event is not None and not self._shared_event:
            event, self._shared_event = tb.event.ipc_handle(), True
        return BufferSlice(tb.generation, numel, buffer=tb.buffer, event=event)

    def _wait_ack(self, key: tuple[int, int]) -> Ack:
        deadline = time.monotonic() + self.ack_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and self.conn.poll(left)
            except (EOFError, OSError) as e:
                raise HandoffError(f"receiver went away while chunk {key[1]} of version {key[0]} was in flight; "
                                   "its bucket stays held") from e
            if not ready:
                raise HandoffTimeout(f"no ack for chunk {key[1]} of version {key[0]} within {self.ack_timeout_s:g} s; "
                                     "its bucket stays held until the ack arrives (collect())")
            try:
                ack = self.conn.recv()
            except (EOFError, OSError) as e:
                raise HandoffError(f"receiver closed the connection before acking chunk {key[1]} of version "
                                   f"{key[0]}; its bucket stays held") from e
            if (ack.version, ack.index) == key:
                return ack
            self._release((ack.version, ack.index))  # a late ack of an earlier timed-out chunk

    def _release(self, key: tuple[int, int]) -> None:
        bucket = self.unacked.pop(key, None)
        if bucket is not None and bucket.is_cuda:
            del bucket
            torch.cuda.ipc_collect()  # the receiver already dropped its reference: the block can go now

    def collect(self) -> int:
        """Release buckets whose late acks have arrived; returns how many are still unacked."""
        if self.conn is None:  # acks reach the feed's source, which shares them (k3.transport.fed_producer)
            return len(self.unacked)
        try:
            while self.unacked and self.conn.poll(0):
                ack = self.conn.recv()
                self._release((ack.version, ack.index))
        except (EOFError, OSError):
            pass
        return len(self.unacked)

    def discard_after_receiver_exit(self) -> list[str]:
        """Free what a receiver that died mid-version left behind; returns the ``/dev/shm`` names it removed.

        Call this only once the receiver process is known to be gone (joined, or reported dead by Ray). A
        receiver killed while it mapped a CPU bucket never drops its reference, so torch's ref-counted segment
        outlives every live holder and stays in ``/dev/shm`` until this process exits. Here every unacked
        bucket and the transfer buffer are dropped; a segment that still exists although nothing in this
        process holds its storage any more is held only by the dead receiver, and is unlinked. Its ref count
        never drops to zero after that, so torch never unlinks it a second time. A segment still held here
        (someone kept a reference to the bucket) is left alone. The producer is closed afterwards.
        """
        self._handed_out = None  # a destination the exporter was writing when the receiver died: never sent
        buckets = list(self.unacked.values())
        if self.transfer_buffer is not None and self.transfer_buffer._buffer is not None:
            buckets.append(self.transfer_buffer._buffer)
        candidates: list[tuple[str, weakref.ref]] = []
        for bucket in buckets:
            if bucket.device.type == "cpu" and bucket.is_shared():
                storage = bucket.untyped_storage()
                name = storage._share_filename_cpu_()[1]
                candidates.append((name.decode() if isinstance(name, bytes) else name, weakref.ref(storage)))
                del storage
            del bucket  # the loop variable would keep the last bucket's segment alive
        del buckets
        self.unacked.clear()
        self._closed = True
        if self.transfer_buffer is not None:
            self.transfer_buffer.release()
        gc.collect()
        removed = []
        for name, storage_ref in candidates:
            if storage_ref() is not None:
                continue
            try:
                os.unlink(os.path.join("/dev/shm", name.lstrip("/")))
            except FileNotFoundError:
                continue  # the receiver had not mapped it: torch unlinked it when the last reference went
            removed.append(name)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()
        return removed

    # ------------------------------------------------------------------ one version
    def send_version(self, chunks: Iterable[ChunkLike]) -> Ack:
        """Send a whole version chunk by chunk (each acked before the next); returns the last chunk's ack.

        The stream must be one version, first chunk ``is_first``, last ``is_last``, nothing after it.
        Each chunk is dropped as soon as it is in its bucket, so at most one exported chunk is alive here.
        """
        version: int | None = None
        last: Ack | None = None
        last_is_last = False
        index = 0
        try:
            for chunk in chunks:
                if version is None:
                    version = chunk.version
                    if not chunk.is_first:
                        raise HandoffError(f"version {version}: the first chunk is not marked is_first")
                elif last_is_last:
                    raise HandoffError(f"version {version}: chunk {index} comes after the chunk marked is_last")
                elif chunk.version != version:
                    raise HandoffError(f"version {version}: chunk {index} carries version {chunk.version}")
                elif chunk.is_first:
                    raise HandoffError(f"version {version}: chunk {index} is marked is_first")
                last_is_last = chunk.is_last
                last = self.send_chunk(chunk, index)
                del chunk
                index += 1
        except BaseException:
            # A chunk exported in place aliases its bucket, and the exporter's suspended generator holds the one it
            # made last: drop both, so that after a failure only ``unacked`` holds a bucket (and
            # ``discard_after_receiver_exit`` can tell a dead receiver's segment from one still in use).
            chunk = None  # noqa: F841 - the frame outlives this call in the traceback
            if hasattr(chunks, "close"):
                chunks.close()
            raise
        if last is None:
            raise HandoffError("send_version got no chunks")
        if not last_is_last:
            raise HandoffError(f"version {version}: the stream ended without a chunk marked is_last; the receiver "
                               "keeps its previous version")
        return last

    def close(self) -> None:
        """Tell the receiver to stop, and free the transfer buffer (and a ``bucket_for`` destination never sent)."""
        if not self._closed:
            self._closed = True
            self._handed_out = None
            try:
                if self.conn is not None:
                    self.conn.send(_CLOSE)
            except (BrokenPipeError, OSError):
                pass
            if self.transfer_buffer is not None:
                self.transfer_buffer.release()

    def __enter__(self) -> "AdapterProducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
        except _Reject as e:
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
            raise _Reject(f"version {h.version} chunk {h.index} came as {type(bucket).__name__}; this receiver takes "
                          "one bucket per chunk (per-rank payloads are for an engine fed rank by rank)")
        if h.is_first:
            if h.index != 0:
                raise _Reject(f"chunk marked is_first has index {h.index}")
            if h.version <= self.active_version:
                raise _Reject(f"version {h.version} is not newer than the active version {self.active_version}")
            self._staging, self._staging_version, self._next_index = {}, h.version, 0
        elif self._staging is None:
            raise _Reject(f"chunk {h.index} of version {h.version} arrived with no version open (is_first missing, "
                          "or the version was already rejected)")
        elif h.version != self._staging_version:
            raise _Reject(f"chunk {h.index} carries version {h.version} inside version {self._staging_version}")
        if h.index != self._next_index:
            raise _Reject(f"version {h.version}: chunk index {h.index}, expected {self._next_index}")
        if bucket.dim() != 1 or bucket.numel() != h.numel or bucket.dtype != h.dtype:
            raise _Reject(f"version {h.version} chunk {h.index}: bucket {tuple(bucket.shape)} {bucket.dtype}, the "
                          f"header describes {h.numel} elements of {h.dtype}")
        for name, shape in zip(h.names, h.shapes, strict=True):
            if name in self._staging or h.names.count(name) > 1:
                raise _Reject(f"version {h.version}: {name} delivered twice")
            if self.expected is not None:
                if name not in self.expected:
                    raise _Reject(f"version {h.version}: unexpected adapter tensor {name}")
                if tuple(shape) != self.expected[name]:
                    raise _Reject(f"version {h.version}: {name} has shape {tuple(shape)}, expected "
                                  f"{self.expected[name]}")
        # One copy of the whole chunk (one kernel on CUDA), cut into views: the tensors of a chunk share storage.
        flat = bucket.to(self.device or bucket.device, copy=True)
        self._staging.update(unflatten(flat, h.names, h.shapes))
        if consumed is not None:
            consumed.record(torch.cuda.current_stream(bucket.device))
        else:
            _sync_device(bucket.device)  # the copy must be done before the ack lets the producer reuse the bucket
        self._next_index += 1
        if not h.is_last:
            return None
        if consumed is not None and self.on_activate is not None:
            _sync_device(bucket.device)  # an engine may load the adapter on other streams or processes
        if self.expected is not None:
            missing = sorted(set(self.expected) - set(self._staging))
            if missing:
                raise _Reject(f"version {h.version} ended with {len(missing)} adapter tensors missing, e.g. {missing[:3]}")
        staged, self._staging = self._staging, None
        if self.on_activate is not None:
            try:
                self.on_activate(h.version, staged, h.config)
            except Exception as e:  # noqa: BLE001 - the engine's error goes back to the trainer in the ack
                raise _Reject(f"version {h.version}: loading the adapter failed: {type(e).__name__}: {e}") from e
        digest = digest_tensors(staged.items()) if self.digest else None
        self.active = {} if self.on_activate is not None else staged
        self.active_version = h.version
        return digest


@dataclass(frozen=True)
class LocalBucket:
    """A bucket handed to a receiver in the same process: a key into ``_LOCAL_BUCKETS`` instead of an IPC handle."""

    key: int


# Producer-side registry of same-process buckets in flight; the receiver pops its entry before it acks, so the
# producer's ``unacked`` entry is again the only reference and ``_release`` frees the bucket as for IPC.
_LOCAL_BUCKETS: dict[int, torch.Tensor] = {}


class _Reject(Exception):
    pass


class _MappedBuffer:
    """The receiver's side of one ``TransferBuffer`` generation: the mapped buffer and its interprocess event."""

    def __init__(self, first: BufferSlice, event: "torch.cuda.Event | None" = None) -> None:
        buffer = first.buffer
        self.buffer = _LOCAL_BUCKETS.pop(buffer.key) if isinstance(buffer, LocalBucket) else buffer
        self.generation = first.generation
        # ``event``: the one opened with an earlier generation, which still orders this one's copies
        self.event = (torch.cuda.Event.from_ipc_handle(self.buffer.device, first.event)
                      if first.event is not None else event)

    def chunk(self, s: BufferSlice) -> torch.Tensor:
        """The chunk ``s`` names, as a view of the buffer, ordered after the producer's copy into it."""
        if s.generation != self.generation or s.numel > self.buffer.numel():
            raise _Reject(f"the chunk sits in transfer buffer generation {s.generation} ({s.numel} elements), but "
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
    mapped: _MappedBuffer | None = None
    consumed: torch.cuda.Event | None = None  # recorded behind each copy out of a CUDA transfer buffer
    consumed_sent = False
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if isinstance(msg, str) and msg == _CLOSE:
            return
        header, payload = msg
        del msg
        if isinstance(payload, BufferSlice):
            if payload.buffer is not None:
                event = mapped.event if mapped is not None else None
                mapped = None  # drop the old generation's mapping first: its memory can go on the producer's side
                mapped = _MappedBuffer(payload, event)
                del event
            try:
                if mapped is None:
                    raise _Reject(f"the chunk sits in transfer buffer generation {payload.generation}, which was "
                                  "never shared with this receiver")
                bucket = mapped.chunk(payload)
            except _Reject as e:
                conn.send(receiver.refuse(header, str(e)))
                continue
        elif isinstance(payload, LocalBucket):
            bucket = _LOCAL_BUCKETS.pop(payload.key)
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
