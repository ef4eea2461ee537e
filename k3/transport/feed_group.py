"""The trainer ranks that feed one engine, as one Gloo group (recipe §4.5, the "IPC gather group"): each rank's
payload gathered to the source, the engine's answer shared from the source.

:func:`join_feeds` is collective over every trainer rank: ``torch.distributed.new_group`` must be entered by every
process of the job, in the same order, for every group, so every rank creates the group of every engine (a rank
that feeds none too) and then checks that it runs where the engine rank it feeds runs. A feed of one rank needs no
group (and no process group at all: the one-rank trainer of ``--backend torch``).

Only payload bytes (handle-sized: the tensors stay on their GPUs) and the engine's answers cross the group, over
Gloo (TCP, across nodes), whatever backend the trainer's default group uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from k3.transport.rank_feed import RankFeed, RankFeedError, check_member_placement

__all__ = ["FeedGroup", "join_feeds"]


class FeedGroup:
    """This trainer rank's place in the feed of one engine: ``feed``, this ``rank``, the ``node`` it runs on, and
    the Gloo ``group`` over the feed's ranks (None for a feed of one rank)."""

    def __init__(self, feed: RankFeed, rank: int, node: str, group: Any | None) -> None:
        if rank not in feed.ranks:
            raise RankFeedError(f"trainer rank {rank} feeds no rank of engine {feed.engine_index}")
        if group is None and len(feed.slots) > 1:
            raise ValueError(f"engine {feed.engine_index} is fed by {len(feed.slots)} trainer ranks: it needs their "
                             "Gloo group")
        self.feed = feed
        self.rank = rank
        self.node = node
        self.position = feed.ranks.index(rank)  # the engine rank this trainer rank feeds
        self._group = group

    @property
    def is_source(self) -> bool:
        """Whether this rank gathers the payloads and talks to the engine (engine rank 0's trainer rank)."""
        return self.position == 0

    @property
    def size(self) -> int:
        return len(self.feed.slots)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in engine-rank order, on the source (None elsewhere). Collective over the feed."""
        if self._group is None:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_source else None
        dist.gather_object(obj, out, dst=self.feed.source_rank, group=self._group)
        return out

    def share(self, obj: Any) -> Any:
        """The source's ``obj`` on every rank of the feed (the others pass anything). Collective: no rank returns
        before the source has called it, so it orders every rank after what the source did first."""
        if self._group is None:
            return obj
        box = [obj if self.is_source else None]
        dist.broadcast_object_list(box, src=self.feed.source_rank, group=self._group)
        return box[0]


def join_feeds(feeds: Sequence[RankFeed], rank: int, node: str, gpu: str | None,
               timeout: timedelta | None = None) -> FeedGroup | None:
    """Create the Gloo group of every feed of more than one rank (collective over every trainer rank, in
    ``feeds`` order) and return this rank's :class:`FeedGroup`, or None when it feeds no engine.

    ``node`` / ``gpu``: where this rank runs (``this_node()``, ``this_gpu(device)``); a rank that is not on its
    engine rank's node (or GPU) raises :class:`RankFeedError` after every group exists, so no other rank waits
    on it. ``timeout``: the groups' collective timeout (None: torch's default)."""
    seen: dict[int, int] = {}
    for feed in feeds:
        for r in feed.ranks:
            if r in seen:
                raise RankFeedError(f"trainer rank {r} would feed both engine {seen[r]} and engine "
                                    f"{feed.engine_index}")
            seen[r] = feed.engine_index
    mine: tuple[RankFeed, Any] | None = None
    for feed in feeds:
        group = None
        if len(feed.slots) > 1:
            if not dist.is_available() or not dist.is_initialized():
                raise RankFeedError(f"engine {feed.engine_index} is fed by trainer ranks {list(feed.ranks)}, but "
                                    "this trainer has no process group to gather their payloads over")
            group = dist.new_group(list(feed.ranks), timeout=timeout, backend="gloo")
        if rank in feed.ranks:
            mine = (feed, group)
    if mine is None:
        return None
    feed, group = mine
    check_member_placement(feed, rank, node, gpu)
    return FeedGroup(feed, rank, node, group)
