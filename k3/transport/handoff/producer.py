"""The sending end: a trainer rank's :class:`AdapterProducer`, one connection to a receiver."""

from __future__ import annotations

import gc
import os
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from k3.transport.handoff.buckets import flatten_into, resolved_device, sync_device, use_file_system_sharing
from k3.transport.handoff.transfer_buffer import TransferBuffer
from k3.transport.handoff.wire import (CLOSE, LOCAL_BUCKETS, Ack, BufferSlice, ChunkHeader, ChunkLike, HandoffError,
                                       HandoffRejected, HandoffTimeout, LocalBucket)


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
            sync_device(bucket.device)  # no IPC event between two threads of one process: finish the copy here
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
        LOCAL_BUCKETS[token.key] = tensor
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
                    self.conn.send(CLOSE)
            except (BrokenPipeError, OSError):
                pass
            if self.transfer_buffer is not None:
                self.transfer_buffer.release()

    def __enter__(self) -> "AdapterProducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
