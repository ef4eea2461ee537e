"""Where the workers of every SGLang engine run: engine ``e`` takes the training ranks ``e·TP … (e+1)·TP − 1`` and
one worker per node it spans, in the bundle of the first of its ranks on that node; and the node addresses and
free ports a multi-node engine starts with."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PROBE_SHARE", "EngineNode", "free_port_run", "node_ip", "plan_engine_nodes", "probe_bundles"]

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
    ``visible_devices`` None). Raises ``ValueError`` when the ranks do not cover the engines or an engine spans
    its nodes unevenly (SGLang gives every node of an engine the same number of TP ranks)."""
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
        nodes = []
        for k, (ip, node_ranks) in enumerate(by_node.items()):
            gpus = [list(bundles[r][1]) for r in node_ranks]
            devices = None if any(not g for g in gpus) else tuple(str(g[0]) for g in gpus)
            nodes.append(EngineNode(e, k, ip, node_ranks[0], tuple(node_ranks), devices))
        plans.append(nodes)
    return plans


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
    """This node's IP: as Ray knows it when Ray is up, else the host name's address."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


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
