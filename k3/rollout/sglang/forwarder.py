"""The adapter hand-off's receiver for an SGLang engine: every chunk checked, then forwarded into SGLang at once.

The head worker of an engine listens on the same socket hand-off as the embedded engine
(``k3.transport.handoff.serve``); :class:`SGLangAdapterForwarder` checks every chunk with the hand-off's
``AdapterReceiver`` (version, order, names, shapes, completeness — holding shapes only, on the ``meta`` device:
SGLang holds the adapter) and forwards it at once through ``SGLangEngine.begin_adapter`` / ``AdapterLoad``
as one ``load_lora_adapter_from_tensors`` call with its first/last flags (recipe §4.5); the first chunk of a
new version unloads the old one, the last sets ``update_weight_version``.

A chunk arrives in one of two forms:

* per-rank payloads (``k3.transport.rank_feed.RankPayloads``: an engine fed rank by rank, the recipe's way and the
  only one for an engine that spans nodes): engine rank ``i``'s payload was made by the trainer rank on its GPU.
  They are checked against the engine's ``RankFeed`` (made by that trainer rank, on that node and GPU, of the same
  chunk as the source's: ``check_rank_payloads``) and passed to SGLang as they are; nothing here opens them;
* one bucket (an engine on one node without a feed, or ``whole`` mode): copied into SGLang's flattened bucket
  here and serialized once per TP rank (``SGLangBackend.load_lora_bucket``).

A chunk the checks reject, or one SGLang fails to load, aborts the version: what SGLang received of it is unloaded,
so a partial version is never served, and the ack says which adapter the engine serves now. The chunk is acked
only after SGLang returned, so the trainer frees its buckets only then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from k3.lora.export import AdapterChunk
from k3.rollout.errors import AdapterVersionError
from k3.transport.handoff import Ack, AdapterReceiver, unflatten
from k3.transport.rank_feed import RankFeed, RankFeedError, RankPayloads, check_rank_payloads

__all__ = ["SGLangAdapterForwarder"]


class SGLangAdapterForwarder:
    """``serve(conn, forwarder)``'s receiver for an SGLang engine: ``receive(header, bucket) -> Ack`` per chunk.

    ``engine``: the ``SGLangEngine``; ``expected``: ``{peft_name: shape}`` of a complete version (``chunk_layout``);
    ``run(fn, *args)``: runs ``fn`` on the engine's thread (default: here); ``feed``: the engine's ``RankFeed``
    when its trainer ranks feed it rank by rank (None: one bucket per chunk).
    """

    def __init__(self, engine: Any, expected: Mapping[str, Sequence[int]],
                 run: Callable[..., Any] | None = None, feed: RankFeed | None = None) -> None:
        self.engine = engine
        self.feed = feed
        # Shapes only: ``meta`` copies hold no memory, and no digest (it would need the data).
        self.checker = AdapterReceiver(expected=expected, device="meta", digest=False)
        self._run = run or (lambda fn, *args: fn(*args))
        self._load: Any | None = None
        self.forwarded = 0  # chunks SGLang accepted, over the run

    def receive(self, header: Any, bucket: Any) -> Any:
        """Check one chunk (``bucket``: a tensor, or ``RankPayloads``), forward it to SGLang, ack; never raises
        (errors go back in the ack)."""
        # Per-rank payloads are checked for names and shapes through a stand-in: they are not opened here.
        shaped = (torch.empty(header.numel, dtype=header.dtype, device="meta") if isinstance(bucket, RankPayloads)
                  else bucket)
        ack = self.checker.receive(header, shaped)
        del shaped
        if not ack.ok:
            try:
                self._run(self._abort, ack.error)
            except Exception as e:  # noqa: BLE001 - the rejection is what the trainer must hear
                ack = dataclasses.replace(ack, error=f"{ack.error}; aborting the partial version failed: {e}")
            return dataclasses.replace(ack, active_version=self._active())
        try:
            self._run(self._forward, header, bucket)
        except Exception as e:  # noqa: BLE001 - the trainer gets the reason in the ack and fails the sync
            error = f"{type(e).__name__}: {e}"
            self.checker.refuse(header, error)  # the half-checked version goes too
            try:
                error = self._run(self._abort, error) or error
            except Exception as cleanup:  # noqa: BLE001
                error = f"{error}; aborting the partial version failed: {cleanup}"
            return Ack(header.version, header.index, ok=False, error=error, active_version=self._active())
        return Ack(header.version, header.index, ok=True, active_version=self._active())

    def _active(self) -> int:
        try:
            return int(self._run(self.engine.adapter_version))
        except Exception:  # noqa: BLE001 - a shut-down engine serves nothing
            return 0

    def _forward(self, header: Any, bucket: Any) -> None:
        if header.is_first:
            if self._load is not None and self._load.is_open:  # the checker refuses this; defensive only
                self._load.abort(RuntimeError(f"version {header.version} began before version "
                                              f"{self._load.version} ended"))
            self._load = self.engine.begin_adapter(header.version)
        if self._load is None or not self._load.is_open:
            raise RuntimeError(f"chunk {header.index} of version {header.version}: no version is being loaded")
        load = self._load
        if isinstance(bucket, RankPayloads):
            self._forward_payloads(header, bucket, load)
        else:
            self._forward_bucket(header, bucket, load)
        self.forwarded += 1
        if header.is_last:
            self._load = None
            load.finish()

    def _forward_payloads(self, header: Any, payloads: RankPayloads, load: Any) -> None:
        if self.feed is None:
            raise RankFeedError(f"chunk {header.index} of version {header.version} came as per-rank payloads, but "
                                "this engine was not set up to be fed rank by rank")
        problems = check_rank_payloads(self.feed, header.version, header.index, payloads)
        if problems:
            raise RankFeedError("; ".join(problems))
        # Names and shapes for the stream's checks; the tensors themselves are in the payloads.
        chunk = AdapterChunk([(n, torch.empty(s, dtype=header.dtype, device="meta"))
                              for n, s in zip(header.names, header.shapes)],
                             header.version, header.is_first, header.is_last, config=dict(header.config))
        source = payloads.payloads[0]
        load.add_payloads(chunk, [p.data for p in payloads.payloads], source.digest, source.checksums)

    def _forward_bucket(self, header: Any, bucket: torch.Tensor, load: Any) -> None:
        if self.feed is not None and self.feed.spans_nodes:
            nodes = sorted({s.node for s in self.feed.slots})
            raise RankFeedError(f"engine {self.feed.engine_index} spans nodes {nodes}: chunk {header.index} of "
                                f"version {header.version} came as one bucket, whose CUDA IPC handle the ranks on "
                                "other nodes cannot open; every trainer rank of the engine must send its own "
                                "payload (TrainerWorker.join_rank_feeds)")
        tensors = unflatten(bucket, header.names, header.shapes)
        if self.engine.load_mode == "whole":
            # Kept until the version's last chunk: copies, since the trainer frees (or overwrites) the bucket on
            # the ack. Streamed, SGLang's payload is built from the views (a copy) and sent before the ack.
            tensors = [(name, t.clone()) for name, t in tensors]
        chunk = AdapterChunk(tensors, header.version, header.is_first, header.is_last, config=dict(header.config))
        del tensors
        load.add(chunk)
        del chunk  # streamed: no reference to the bucket may outlive the ack

    def _abort(self, reason: str) -> str | None:
        """Abort the version being loaded, if one is; returns the error that says what the engine serves now."""
        load, self._load = self._load, None
        if load is not None and load.is_open:
            return str(load.abort(AdapterVersionError(reason)))
        return None
