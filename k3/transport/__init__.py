"""Adapter chunk hand-off between processes (CUDA IPC / shared memory), and the leak gate around it."""

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

__all__ = [
    "Ack", "AdapterProducer", "AdapterReceiver", "BufferSlice", "ChunkHeader", "HandoffError", "HandoffRejected",
    "HandoffTimeout", "TransferBuffer", "spawn_receiver", "LeakCheck", "LeakError", "LeakReport",
]
