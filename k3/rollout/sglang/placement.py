"""Where the workers of every SGLang engine run: engine ``e`` takes the training ranks ``e·TP … (e+1)·TP − 1`` and
one worker per node it spans, in the bundle of the first of its ranks on that node; which trainer rank, node and
GPU each engine rank has (``engine_rank_slots``: engine rank ``i`` is training rank ``e·TP + i``'s GPU); and the
node addresses and free ports a multi-node engine starts with."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3.transport.rank_feed import RankSlot, this_node

__all__ = ["PROBE_SHARE", "EngineNode", "engine_rank_slots", "free_port_run", "node_ip", "plan_engine_nodes",
           "probe_bundles"]

PROBE_SHARE = 0.01  # of a rank's bundle, for the task that reports the bundle's node and GPU


@dataclass(frozen=True)
class EngineNode:
    """Where one worker of one engine runs: ``bundle_rank`` is the training rank whose bundle hosts it (the first
    of ``ranks``, the engine's training ranks on that node); ``visible_devices`` their GPU ids in rank order."""

    engine_index: int
    node_rank: int
    node_ip: str
    bundle_rank: int
    ranks: tuple[int, ...]
    visible_devices: tuple[str, ...] | None


def plan_engine_nodes(num_engines: int, engine_tp: int,
                      bundles: Sequence[tuple[str, Sequence[Any]]]) -> list[list[EngineNode]]:
    """The workers of every engine: engine ``e`` takes training ranks ``e·engine_tp … (e+1)·engine_tp − 1``;
    its node ranks follow its nodes in rank order (node rank 0 holds rank ``e·engine_tp``, the source rank of the
    adapter hand-off). ``bundles[r]`` is ``(node IP, GPU ids)`` of rank ``r``'s bundle (no GPU ids: a CPU run,
    ``visible_devices`` None). Raises ``ValueError`` when the ranks do not cover the engines, an engine spans
    its nodes unevenly (SGLang gives every node of an engine the same number of TP ranks), or an engine's ranks
    interleave over its nodes (SGLang puts TP ranks ``k·n … (k+1)·n − 1`` on node rank ``k``, so node ``k`` must
    hold training ranks ``e·TP + k·n …`` for each engine rank to sit on its training rank's GPU)."""
    if num_engines < 1 or engine_tp < 1:
        raise ValueError(f"num_engines={num_engines}, engine_tp={engine_tp}: both must be >= 1")
    need = num_engines * engine_tp
    if len(bundles) < need:
        raise ValueError(f"{num_engines} engines of TP {engine_tp} need {need} GPU bundles; the placement has "
                         f"{len(bundles)}")
    plans = []
    for e in range(num_engines):
        ranks = list(range(e * engine_tp, (e + 1) * engine_tp))
        by_node: dict[str, list[int]] = {}
        for r in ranks:
            by_node.setdefault(str(bundles[r][0]), []).append(r)
        sizes = {len(v) for v in by_node.values()}
        if len(sizes) != 1:
            raise ValueError(f"engine {e} (ranks {ranks[0]}..{ranks[-1]}) spans its nodes unevenly "
                             f"({ {ip: len(v) for ip, v in by_node.items()} }): SGLang needs the same TP ranks on "
                             "every node of an engine; use whole nodes per engine (--rollout-tp-size)")
        per_node = sizes.pop()
        if any(node_ranks != ranks[k * per_node:(k + 1) * per_node] for k, node_ranks in enumerate(by_node.values())):
            where = "; ".join(f"node {ip}: ranks {v} on GPUs {[list(bundles[r][1]) for r in v]}"
                              for ip, v in by_node.items())
            raise ValueError(f"engine {e}'s training ranks interleave over its nodes ({where}): SGLang puts TP "
                             f"ranks k·{per_node} … (k+1)·{per_node} − 1 on its k-th node, so each engine rank would "
                             "sit on another training rank's GPU and open adapter payloads made elsewhere; place each "
                             "engine's ranks node by node")
        nodes = []
        for k, (ip, node_ranks) in enumerate(by_node.items()):
            gpus = [list(bundles[r][1]) for r in node_ranks]
            devices = None if any(not g for g in gpus) else tuple(str(g[0]) for g in gpus)
            nodes.append(EngineNode(e, k, ip, node_ranks[0], tuple(node_ranks), devices))
        plans.append(nodes)
    return plans


def engine_rank_slots(nodes: Sequence[EngineNode]) -> tuple[RankSlot, ...]:
    """Engine rank ``i``'s trainer rank, node and GPU at ``i``, of one engine's workers (``plan_engine_nodes``):
    its nodes in node-rank order, each node's ranks in order, as SGLang numbers its TP ranks."""
    slots = []
    for node in sorted(nodes, key=lambda n: n.node_rank):
        gpus = node.visible_devices or (None,) * len(node.ranks)
        slots.extend(RankSlot(r, node.node_ip, gpu) for r, gpu in zip(node.ranks, gpus))
    first = slots[0].rank if slots else 0
    if [s.rank for s in slots] != list(range(first, first + len(slots))):
        raise ValueError(f"engine {nodes[0].engine_index}: its node workers hold training ranks "
                         f"{[s.rank for s in slots]}, not one run of consecutive ranks in node order")
    return tuple(slots)


def _bundle_identity() -> tuple[str, list[str]]:
    import ray

    return node_ip(), [str(g) for g in ray.get_gpu_ids()]


def probe_bundles(placement: Any, num_ranks: int) -> list[tuple[str, list[str]]]:
    """``(node IP, GPU ids)`` of the bundles of training ranks ``0 … num_ranks − 1`` (one tiny task in each)."""
    import ray

    probe = ray.remote(_bundle_identity)
    return ray.get([probe.options(**placement.actor_options(r, share=PROBE_SHARE)).remote()
                    for r in range(num_ranks)])


def node_ip() -> str:
    """This node's IP: as Ray knows it when Ray is up, else the host name's address (``this_node``: the id the
    trainer ranks report, so the placement and the rank feed's checks agree)."""
    return this_node()


def free_port_run(start: int, span: int) -> int:
    """The first port ``p >= start`` with ``p … p + span − 1`` all free on this node."""
    p = start
    while p + span <= 65_536:
        for q in range(p, p + span):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", q))
                except OSError:
                    p = q + 1
                    break
        else:
            return p
    raise RuntimeError(f"no {span} consecutive free ports from {start} on this node")
