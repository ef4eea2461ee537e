"""Every SGLang engine of a run, started: under Ray, each engine's node workers in their bundles (followers learn
their head's address first); in process, the one engine. The engines are sized by the run's ``ParallelLayout``
(``num_rollout_engines`` × ``rollout_tp_size``) and configured by its ``RolloutSettings`` /
``ColocateSettings`` and the worker spec's adapters; ``placement`` is the run's Ray placement (duck-typed:
``create_actor``, ``actor_options``)."""

from __future__ import annotations

from typing import Any

from k3.rollout.sglang.placement import engine_rank_slots, plan_engine_nodes, probe_bundles
from k3.rollout.sglang.server_args import build_server_args
from k3.rollout.sglang.worker import SGLangEngineWorker
from k3.settings.colocate import ColocateSettings
from k3.settings.parallel import ParallelLayout
from k3.settings.rollout import RolloutSettings
from k3.settings.worker import WorkerSpec
from k3.transport.rank_feed import RankSlot, this_node

__all__ = ["launch_engines", "start_engines", "start_local_engine"]


def _engine_kwargs(rollout: RolloutSettings) -> dict[str, Any]:
    return {"sglang_path": rollout.sglang_path, "verify_checksums": bool(rollout.check_weight_update_equal)}


def launch_engines(rollout: RolloutSettings, layout: ParallelLayout, colocate: ColocateSettings, placement: Any,
                   spec: WorkerSpec) -> list[Any]:
    """Start every rollout engine of ``layout`` on ``placement`` (Ray); returns the heads' actor handles, in
    engine order. Followers are created in their bundles too (the placement kills them at shutdown). Each head
    knows its engine ranks' trainer ranks, nodes and GPUs (``engine_rank_slots``), to be fed rank by rank."""
    import ray

    plans = plan_engine_nodes(layout.num_rollout_engines, layout.rollout_tp_size,
                              probe_bundles(placement, layout.num_rollout_engines * layout.rollout_tp_size))
    cls = ray.remote(SGLangEngineWorker)
    heads, started = [], []
    for nodes in plans:
        slots = engine_rank_slots(nodes)
        actors = [placement.create_actor(cls, n.bundle_rank, "engine", spec, engine_index=n.engine_index,
                                         node_rank=n.node_rank, visible_devices=n.visible_devices,
                                         **({"rank_slots": slots} if n.node_rank == 0 else {}),
                                         **_engine_kwargs(rollout)) for n in nodes]
        overrides: dict[str, Any] = {}
        if len(nodes) > 1:
            ip, port = ray.get(actors[0].node_address.remote())
            overrides["dist_init_addr"] = f"{ip}:{port}"
        for node, actor in zip(nodes, actors):
            node_rank = node.node_rank if len(nodes) > 1 else None
            started.append(actor.start.remote(build_server_args(rollout, spec.lora, colocate, **overrides,
                                                                node_rank=node_rank)))
        heads.append(actors[0])
    ray.get(started)  # every node of every engine up (the TP ranks of an engine start together)
    return heads


def start_local_engine(rollout: RolloutSettings, layout: ParallelLayout, colocate: ColocateSettings,
                       spec: WorkerSpec) -> SGLangEngineWorker:
    """The one engine of an in-process run (tests, one-GPU machines), started. An engine of one rank is fed by
    the one trainer rank of this process (its node; the GPU is not compared: both share this process's view of
    the node's GPUs); a wider one takes one bucket per chunk, which its ranks on this node open."""
    if layout.num_rollout_engines != 1:
        raise ValueError(f"an in-process run has one rollout engine; this layout has "
                         f"{layout.num_rollout_engines} (run it under Ray)")
    server_args = build_server_args(rollout, spec.lora, colocate)
    slots = (RankSlot(0, this_node(), None),) if int(server_args.get("tp_size", 1)) == 1 else None
    worker = SGLangEngineWorker(spec, rank_slots=slots, **_engine_kwargs(rollout))
    worker.start(server_args)
    return worker


def start_engines(rollout: RolloutSettings, layout: ParallelLayout, colocate: ColocateSettings, spec: WorkerSpec,
                  placement: Any | None) -> list[Any]:
    """Every rollout engine of the run, started: the one in-process :class:`SGLangEngineWorker` when
    ``placement`` is None, else the heads' Ray actor handles (:func:`launch_engines`), in engine order."""
    if placement is None:
        return [start_local_engine(rollout, layout, colocate, spec)]
    return launch_engines(rollout, layout, colocate, placement, spec)
