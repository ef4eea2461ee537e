"""The producing end on one trainer rank of an engine fed rank by rank (``k3.transport.rank_feed``; recipe §4.5).

Per chunk, on every trainer rank of the engine's feed, in step:

1. the rank puts its own full copy of the chunk in a bucket on its own device (exported in place, copied into a
   fresh bucket, or into the persistent ``TransferBuffer``: ``AdapterProducer``'s buckets), waits for the writes,
   digests the chunk and makes its payload with the feed's ``make_payload`` (SGLang: the serialized flattened
   bucket, a CUDA IPC handle or a shared-memory name). A rank that cannot sends the reason in its place;
2. the payloads are gathered to the source over the feed's Gloo group — handle bytes only;
3. the source sends the engine the chunk's header and the payloads in engine-rank order
   (:class:`~k3.transport.rank_feed.RankPayloads`), and waits for its ack;
4. the source shares the engine's answer with every rank of the feed: no rank frees (or overwrites) its bucket
   before the engine has replied (the recipe's barrier after each chunk; AG freed non-source buckets right after
   the gather and hit IPC unlink failures). Every rank then returns the ack or raises the same error.

The engine checks what it got (``check_rank_payloads``): every payload made by its engine rank's trainer rank, on
that rank's node and GPU, of the same chunk as the source's (digests equal); a payload a rank could not make, or one
that does not fit, refuses the chunk and the engine drops the partial version.

When the engine never answers (the connection broke, or no ack in time), every rank keeps its bucket: the engine
may still read it. The run fails then, and ``discard_after_receiver_exit`` / the process's exit frees them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from k3.transport.feed_group import FeedGroup
from k3.transport.handoff import (Ack, AdapterProducer, ChunkHeader, ChunkLike, HandoffError, HandoffRejected,
                                  HandoffTimeout, TransferBuffer, sync_device, unflatten)
from k3.transport.rank_feed import RankPayload, RankPayloads, this_gpu

__all__ = ["DigestFn", "FedProducer"]

# The digest of a chunk's named tensors (``k3.lora.digest.chunk_digest``: what the engine reports back).
DigestFn = Callable[[Sequence[tuple[str, torch.Tensor]]], str]


@dataclass(frozen=True)
class _Outcome:
    """The engine's answer to one chunk as the source shares it: the ack, or why there is none."""

    ack: Ack | None
    broken: str = ""
    timed_out: bool = False


class FedProducer(AdapterProducer):
    """The producing end of one trainer rank in an engine's feed (see the module docstring).

    ``conn``: the connection to the engine on the source, None on every other rank; ``group``: this rank's
    ``FeedGroup``; ``digest_of``: the chunk digest each rank puts next to its payload (the source's are the
    sync's record, ``version_digests``). The other arguments are ``AdapterProducer``'s.
    """

    def __init__(self, conn: Connection | None, group: FeedGroup, digest_of: DigestFn, *,
                 transfer_buffer: TransferBuffer | None = None, ack_timeout_s: float = 60.0,
                 on_bucket: Callable[[torch.Tensor], None] | None = None, same_process: bool = False) -> None:
        if (conn is not None) != group.is_source:
            raise ValueError(f"engine {group.feed.engine_index}: trainer rank {group.rank} "
                             f"{'is its source and needs a' if group.is_source else 'is not its source and takes no'} "
                             "connection to the engine")
        super().__init__(conn, transfer_buffer=transfer_buffer, ack_timeout_s=ack_timeout_s, on_bucket=on_bucket,
                         same_process=same_process)
        self.group = group
        self.digest_of = digest_of
        self.version_digests: list[str] = []  # of the version being sent, in chunk order

    def send_chunk(self, chunk: ChunkLike, index: int) -> Ack:
        """Make this rank's payload of chunk ``index``, take part in its gather, and (source) deliver it; returns
        the engine's ack on every rank of the feed, or raises its refusal (``HandoffRejected``) on every rank."""
        if self._closed:
            raise HandoffError("producer is closed")
        if index == 0:
            self.version_digests = []
        header, tensors = self._header_of(chunk, index)
        del chunk  # a chunk exported in place is views of its bucket
        key = (header.version, index)
        own = self._own_payload(tensors, header, key)
        del tensors
        engine = self.group.feed.engine_index
        try:
            gathered = self.group.gather(own)
        except Exception as e:  # noqa: BLE001 - a peer died or the group timed out: name the chunk
            raise HandoffError(f"engine {engine}: gathering the rank payloads of chunk {index} of version "
                               f"{header.version} failed on trainer rank {self.group.rank}: "
                               f"{type(e).__name__}: {e}") from e
        outcome = self._deliver(header, gathered, key) if self.group.is_source else None
        del gathered
        try:
            outcome = self.group.share(outcome)
        except Exception as e:  # noqa: BLE001
            raise HandoffError(f"engine {engine}: the engine's answer to chunk {index} of version {header.version} "
                               f"did not reach trainer rank {self.group.rank}: {type(e).__name__}: {e}") from e
        if outcome.ack is None:  # no answer: the engine may still read every rank's bucket, so each keeps its own
            raise (HandoffTimeout if outcome.timed_out else HandoffError)(outcome.broken)
        self._release(key)
        ack = outcome.ack
        if not ack.ok:
            raise HandoffRejected(f"receiver rejected chunk {index} of version {header.version}: {ack.error}")
        if own.error or own.digest is None:  # the engine accepted a chunk this rank failed to make: cannot be
            raise HandoffError(f"engine {engine}: trainer rank {self.group.rank} made no payload of chunk {index} "
                               f"of version {header.version} ({own.error}), yet the engine accepted it")
        self.version_digests.append(own.digest)
        return ack

    def _own_payload(self, tensors: list[torch.Tensor], header: ChunkHeader, key: tuple[int, int]) -> RankPayload:
        """This rank's payload of the chunk (its bucket kept in ``unacked``), or why it has none; never raises, so
        the rank always takes part in the gather."""
        feed = self.group.feed
        try:
            if self.transfer_buffer is not None:
                self._check_buffer_free()
            elif self.unacked:
                self.collect()
            bucket = self._bucket_of(tensors, header, header.index)
            self.unacked[key] = bucket
            # The engine opens the payload with no event to wait on (a reused buffer's handle carries none), and
            # the digest reads the bucket: the writes into it must be done.
            sync_device(bucket.device)
            digest = self.digest_of(unflatten(bucket, header.names, header.shapes))
            data, checksums = feed.make_payload(bucket, header.names, header.shapes,
                                                self.group.is_source and feed.checksums)
            return RankPayload(self.group.rank, self.group.node, this_gpu(bucket.device), data, digest, checksums)
        except Exception as e:  # noqa: BLE001 - the engine names this rank and the chunk in its refusal
            return RankPayload(self.group.rank, self.group.node, None, None, error=f"{type(e).__name__}: {e}")

    def _deliver(self, header: ChunkHeader, gathered: list[RankPayload] | None, key: tuple[int, int]) -> _Outcome:
        """The source's part: every rank's payload to the engine, and its ack (or why there is none)."""
        try:
            self.conn.send((header, RankPayloads(tuple(gathered or ()))))
        except (BrokenPipeError, EOFError, OSError) as e:
            return _Outcome(None, f"receiver connection broke while sending chunk {header.index} of version "
                                  f"{header.version}: {e}")
        try:
            return _Outcome(self._wait_ack(key))
        except HandoffTimeout as e:
            return _Outcome(None, str(e), timed_out=True)
        except HandoffError as e:
            return _Outcome(None, str(e))
