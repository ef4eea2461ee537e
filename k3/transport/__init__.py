"""Adapter chunk hand-off between processes (CUDA IPC / shared memory), the leak gate around it, and the feed of
an engine rank by rank: each engine rank's payload from the trainer rank on its GPU, gathered over Gloo."""

from k3.transport.fed_producer import FedProducer
from k3.transport.feed_group import FeedGroup, join_feeds
from k3.transport.handoff import (
    Ack,
    AdapterProducer,
    AdapterReceiver,
    BufferSlice,
    ChunkHeader,
    HandoffError,
    HandoffRejected,
    HandoffTimeout,
    TransferBuffer,
    spawn_receiver,
)
from k3.transport.leakcheck import LeakCheck, LeakError, LeakReport
from k3.transport.rank_feed import RankFeed, RankFeedError, RankPayload, RankPayloads, RankSlot

__all__ = [
    "Ack", "AdapterProducer", "AdapterReceiver", "BufferSlice", "ChunkHeader", "HandoffError", "HandoffRejected",
    "HandoffTimeout", "TransferBuffer", "spawn_receiver", "LeakCheck", "LeakError", "LeakReport",
    "FedProducer", "FeedGroup", "join_feeds", "RankFeed", "RankFeedError", "RankPayload", "RankPayloads", "RankSlot",
]
