"""An engine fed rank by rank: which trainer rank makes the payload of each engine rank, where both run, what
travels, and the checks that every payload was made where its engine rank can open it (recipe §4.5).

A rollout engine that is tensor parallel over ``T`` GPUs (SGLang) takes one serialized payload per engine rank per
chunk. A payload holds a CUDA IPC handle (shared memory on the CPU), which only a process on the same node can
open. So engine rank ``i`` takes the payload that trainer rank ``first + i`` — the trainer rank on the same GPU —
made of its own full copy of the chunk. Only the handle bytes cross nodes: the trainer ranks of an engine gather
their payloads to the first of them (the *source*) over a Gloo group (``k3.transport.feed_group``), and the source
hands the list, in engine-rank order, to the engine (``k3.transport.fed_producer``).

:class:`RankFeed` is what an engine asks of the trainer: one :class:`RankSlot` per engine rank (the trainer rank
that feeds it, its node and its GPU) and the function that makes a payload (the engine's wire format: SGLang's
serialized flattened bucket). Each trainer rank sends a :class:`RankPayload` saying who made it, where, and the
digest of the chunk in it; the source sends the engine one :class:`RankPayloads` per chunk.
:func:`check_rank_payloads` (the engine's side) and :func:`check_member_placement` (each trainer rank's, when it
joins) say, naming the engine, the engine rank, the trainer rank, the nodes and GPUs (and the chunk), what does not
fit.

The identity of a process: :func:`this_node` (the node's IP, as Ray knows it when Ray is up) and :func:`this_gpu`
(a CUDA device's physical id, as ``CUDA_VISIBLE_DEVICES`` numbers it: the ids Ray hands out). A payload's GPU is
where its bytes lie (None on the CPU, where shared memory opens from any process of the node, so only the node
is compared).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from k3.transport.handoff import HandoffError

__all__ = ["PayloadMaker", "RankFeed", "RankFeedError", "RankPayload", "RankPayloads", "RankSlot",
           "check_member_placement", "check_rank_payloads", "this_gpu", "this_node"]

# ``make_payload(bucket, names, shapes, with_checksums) -> (payload bytes, {name: sha256} or None)``: ``bucket`` is
# the chunk's 1-D bucket (its tensors back to back, one dtype), ``names``/``shapes`` its tensors in order.
PayloadMaker = Callable[[torch.Tensor, Sequence[str], Sequence[Sequence[int]], bool], tuple[bytes, dict | None]]


class RankFeedError(HandoffError):
    """A rank feed does not fit: a payload made on another node or GPU than its engine rank's, by another trainer
    rank, missing, or of a different chunk; or a trainer rank placed elsewhere than its engine expects."""


@dataclass(frozen=True)
class RankSlot:
    """One engine rank as its feed sees it: the trainer ``rank`` that makes its payloads, on ``node``, ``gpu``
    (the physical GPU id; None on a CPU run)."""

    rank: int
    node: str
    gpu: str | None


@dataclass(frozen=True)
class RankFeed:
    """What engine ``engine_index`` asks of the trainer ranks that feed it: ``slots[i]`` is engine rank ``i``'s
    (in engine-rank order: SGLang's TP rank order); ``make_payload`` makes one payload (a module-level function:
    it travels to the trainer ranks); ``checksums``: the source also sends each tensor's SHA-256, which the engine
    checks on every rank's payload."""

    engine_index: int
    slots: tuple[RankSlot, ...]
    make_payload: PayloadMaker
    checksums: bool = False

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError(f"engine {self.engine_index}: a rank feed needs at least one engine rank")
        ranks = [s.rank for s in self.slots]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"engine {self.engine_index}: trainer ranks {ranks} feed its ranks; each may feed one")

    @property
    def ranks(self) -> tuple[int, ...]:
        """The trainer ranks feeding the engine, in engine-rank order (the first is the source)."""
        return tuple(s.rank for s in self.slots)

    @property
    def source_rank(self) -> int:
        """The trainer rank that gathers the payloads and talks to the engine (on engine rank 0's GPU)."""
        return self.slots[0].rank

    @property
    def spans_nodes(self) -> bool:
        return len({s.node for s in self.slots}) > 1

    def describe(self, position: int) -> str:
        """``engine E rank I (trainer rank R, node N, GPU G)``: how messages name one slot."""
        s = self.slots[position]
        return f"engine {self.engine_index} rank {position} (trainer rank {s.rank}, node {s.node}, GPU {s.gpu})"


@dataclass(frozen=True)
class RankPayload:
    """One trainer rank's payload of one chunk, as it travels to the source: ``data`` (the serialized bucket;
    None when the rank could not make it, ``error`` then says why), made by trainer ``rank`` on ``node`` with its
    bytes on ``gpu`` (None: host memory); ``digest``: the chunk digest of the tensors in it; ``checksums``: each
    tensor's SHA-256 (the source's only, when the feed asks for them)."""

    rank: int
    node: str
    gpu: str | None
    data: bytes | None
    digest: str | None = None
    checksums: dict[str, str] | None = None
    error: str = ""


@dataclass(frozen=True)
class RankPayloads:
    """What the source sends the engine for one chunk: one :class:`RankPayload` per engine rank, in engine-rank
    order (``payloads[0]`` is the source's own)."""

    payloads: tuple[RankPayload, ...]


def check_rank_payloads(feed: RankFeed, version: int, index: int, payloads: RankPayloads) -> list[str]:
    """What does not fit in the payloads of chunk ``index`` of ``version`` (empty: every engine rank gets a payload
    made by its trainer rank, on its node and GPU, of the same chunk as the source's)."""
    chunk = f"chunk {index} of version {version}"
    got = payloads.payloads
    if len(got) != len(feed.slots):
        return [f"engine {feed.engine_index}: {chunk} came with {len(got)} rank payloads; the engine has "
                f"{len(feed.slots)} ranks"]
    problems = []
    reference = got[0].digest
    for i, (slot, p) in enumerate(zip(feed.slots, got)):
        who = feed.describe(i)
        if p.error or p.data is None:
            problems.append(f"{who}: trainer rank {p.rank} on node {p.node} made no payload of {chunk}: "
                            f"{p.error or 'no data'}")
        elif p.rank != slot.rank:
            problems.append(f"{who}: its payload of {chunk} was made by trainer rank {p.rank} (node {p.node}, GPU "
                            f"{p.gpu}), not by the trainer rank on its GPU")
        elif p.node != slot.node:
            problems.append(f"{who}: its payload of {chunk} was made on node {p.node}; a CUDA IPC handle opens only "
                            "on its own node")
        elif p.gpu is not None and slot.gpu is not None and p.gpu != slot.gpu:
            problems.append(f"{who}: its payload of {chunk} lies on GPU {p.gpu} of node {p.node}, not on the "
                            "engine rank's GPU")
        elif p.digest != reference:
            problems.append(f"{who}: trainer rank {p.rank}'s copy of {chunk} differs from the source's (digest "
                            f"{str(p.digest)[:12]}… vs {str(reference)[:12]}…)")
    return problems


def check_member_placement(feed: RankFeed, rank: int, node: str, gpu: str | None) -> None:
    """Raise :class:`RankFeedError` when trainer ``rank`` (running on ``node``, ``gpu``) is not where the engine
    rank it feeds runs: a trainer rank must share its engine rank's node, and its GPU when it has one."""
    if rank not in feed.ranks:
        raise RankFeedError(f"trainer rank {rank} feeds no rank of engine {feed.engine_index} (its feeders are "
                            f"trainer ranks {list(feed.ranks)})")
    position = feed.ranks.index(rank)
    slot = feed.slots[position]
    if slot.node != node or (gpu is not None and slot.gpu is not None and slot.gpu != gpu):
        raise RankFeedError(f"{feed.describe(position)} takes its adapter payloads from trainer rank {rank}, which "
                            f"runs on node {node} GPU {gpu}: the trainer rank on engine rank {position}'s GPU must "
                            "feed it (the engine's TP ranks follow its nodes and each node's GPUs in trainer-rank "
                            "order)")


def this_node() -> str:
    """This node's id for placement checks: its IP as Ray knows it when Ray is up, else the host name's address."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def this_gpu(device: torch.device | str | Any) -> str | None:
    """The physical id of CUDA ``device`` (a bare ``cuda``: the current device) as ``CUDA_VISIBLE_DEVICES`` names
    it (the ids Ray assigns); None for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)
