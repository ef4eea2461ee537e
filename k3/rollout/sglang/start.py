"""Every SGLang engine of a run, started: under Ray, each engine's node workers in their bundles (followers learn
their head's address first); in process, the one engine. ``resolved`` is the run's ``ResolvedConfig`` and
``placement`` its ``RayPlacement`` (duck-typed: ``create_actor``, ``actor_options``)."""

from __future__ import annotations

from typing import Any

from k3.rollout.sglang.placement import plan_engine_nodes, probe_bundles
from k3.rollout.sglang.server_args import build_server_args
from k3.rollout.sglang.worker import SGLangEngineWorker
from k3.settings.worker import WorkerSpec

__all__ = ["launch_engines", "start_engines", "start_local_engine"]


def _engine_kwargs(resolved: Any) -> dict[str, Any]:
    a = resolved.args
    return {"sglang_path": a.sglang_path, "verify_checksums": bool(a.check_weight_update_equal)}


def launch_engines(resolved: Any, placement: Any, spec: WorkerSpec) -> list[Any]:
    """Start every rollout engine of ``resolved`` on ``placement`` (Ray); returns the heads' actor handles, in
    engine order. Followers are created in their bundles too (the placement kills them at shutdown)."""
    import ray

    layout = resolved.layout
    plans = plan_engine_nodes(layout.num_rollout_engines, layout.rollout_tp_size,
                              probe_bundles(placement, layout.num_rollout_engines * layout.rollout_tp_size))
    cls = ray.remote(SGLangEngineWorker)
    heads, started = [], []
    for nodes in plans:
        actors = [placement.create_actor(cls, n.bundle_rank, "engine", spec, engine_index=n.engine_index,
                                         node_rank=n.node_rank, visible_devices=n.visible_devices,
                                         **_engine_kwargs(resolved)) for n in nodes]
        overrides: dict[str, Any] = {}
        if len(nodes) > 1:
            ip, port = ray.get(actors[0].node_address.remote())
            overrides["dist_init_addr"] = f"{ip}:{port}"
        for node, actor in zip(nodes, actors):
            node_rank = node.node_rank if len(nodes) > 1 else None
            started.append(actor.start.remote(build_server_args(resolved, **overrides, node_rank=node_rank)))
        heads.append(actors[0])
    ray.get(started)  # every node of every engine up (the TP ranks of an engine start together)
    return heads


def start_local_engine(resolved: Any, spec: WorkerSpec) -> SGLangEngineWorker:
    """The one engine of an in-process run (tests, one-GPU machines), started."""
    if resolved.layout.num_rollout_engines != 1:
        raise ValueError(f"an in-process run has one rollout engine; this layout has "
                         f"{resolved.layout.num_rollout_engines} (run it under Ray)")
    worker = SGLangEngineWorker(spec, **_engine_kwargs(resolved))
    worker.start(build_server_args(resolved))
    return worker


def start_engines(resolved: Any, spec: WorkerSpec, placement: Any | None) -> list[Any]:
    """Every rollout engine of ``resolved``, started: the one in-process :class:`SGLangEngineWorker` when
    ``placement`` is None, else the heads' Ray actor handles (:func:`launch_engines`), in engine order."""
    if placement is None:
        return [start_local_engine(resolved, spec)]
    return launch_engines(resolved, placement, spec)
