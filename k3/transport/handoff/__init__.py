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

The parts: :mod:`.wire` (what travels), :mod:`.buckets` (a chunk's flat layout), :mod:`.transfer_buffer`,
:mod:`.producer` and :mod:`.receiver`.
"""

from __future__ import annotations

from k3.transport.handoff.buckets import (digest_tensors, flat_views, flatten_into, resolved_device, sync_device,
                                          unflatten, use_file_system_sharing)
from k3.transport.handoff.producer import AdapterProducer
from k3.transport.handoff.receiver import AdapterReceiver, serve, spawn_receiver
from k3.transport.handoff.transfer_buffer import TransferBuffer
from k3.transport.handoff.wire import (LOCAL_BUCKETS, Ack, BufferSlice, ChunkHeader, ChunkLike, HandoffError,
                                       HandoffRejected, HandoffTimeout, LocalBucket)

__all__ = [
    "ChunkHeader", "Ack", "TransferBuffer", "BufferSlice", "LocalBucket", "AdapterProducer", "AdapterReceiver",
    "spawn_receiver", "serve",
    "flatten_into", "flat_views", "unflatten", "resolved_device", "digest_tensors", "use_file_system_sharing",
    "sync_device", "HandoffError", "HandoffRejected", "HandoffTimeout", "ChunkLike", "LOCAL_BUCKETS",
]
