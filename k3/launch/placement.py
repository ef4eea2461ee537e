"""Ray placement: the trainer and the rollout engine of each training rank share that rank's resources.

One placement-group bundle per training rank — ``{"GPU": 1, "CPU": c}`` on GPUs, ``{"CPU": 1}`` on CPU — and every
actor of a rank is created inside that rank's bundle with a fraction of it (:data:`ROLE_SHARES`), so trainer and
engine are colocated on the same device by construction. One node packs strictly (``STRICT_PACK``); several
nodes pack as tightly as the cluster allows (``PACK``). Ranks are numbered node by node.

Ray is started locally (quickly: no dashboard, logical CPUs) unless ``RAY_ADDRESS`` is set, ``K3_EXTERNAL_RAY=1`` /
``--external-ray`` is given, or this process is already connected; then the existing cluster is joined.

:class:`RayPlacement` is a context manager: leaving it — normally, on an exception or on SIGTERM — kills the
actors it created, removes the placement group and disconnects (stopping Ray only if it started it).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from k3.launch.args import ResolvedConfig

__all__ = [
    "PlacementError",
    "PlacementPlan",
    "RayPlacement",
    "ROLE_SHARES",
    "plan_placement",
    "ray_address",
]

log = logging.getLogger(__name__)

# Fraction of a rank's bundle each role takes. Together they leave 0.2 free for small helpers of the rank.
ROLE_SHARES: dict[str, float] = {"trainer": 0.4, "engine": 0.4}
# Host CPUs reserved with each GPU bundle (data loading, reward scoring, the engine's scheduler).
CPUS_PER_GPU_BUNDLE = 1.0
PLACEMENT_TIMEOUT_S = 120.0


class PlacementError(RuntimeError):
    """The cluster cannot hold the run's placement; the message says what is missing."""


@dataclass(frozen=True)
class PlacementPlan:
    """``num_bundles`` identical ``bundle`` s (one per training rank) placed with ``strategy``."""

    num_bundles: int
    bundle: dict[str, float]
    strategy: str
    num_nodes: int = 1
    name: str = "k3"

    def total(self, resource: str) -> float:
        return self.num_bundles * self.bundle.get(resource, 0.0)


def plan_placement(resolved: ResolvedConfig) -> PlacementPlan:
    """The placement of ``resolved``: one bundle per training rank (``layout.world_size``)."""
    args = resolved.args
    if args.num_gpus_per_node:
        bundle = {"GPU": 1.0, "CPU": CPUS_PER_GPU_BUNDLE}
    else:
        bundle = {"CPU": 1.0}
    return PlacementPlan(
        num_bundles=resolved.layout.world_size,
        bundle=bundle,
        strategy="STRICT_PACK" if args.num_nodes == 1 else "PACK",
        num_nodes=args.num_nodes,
        name=f"k3-{args.run_id}",
    )


def ray_address(external_ray: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """Address of the cluster to join, or ``None`` to start a local one.

    ``RAY_ADDRESS`` wins; ``--external-ray`` or ``K3_EXTERNAL_RAY=1`` alone join the cluster Ray finds itself
    (``"auto"``: the one started with ``ray start`` on this machine).
    """
    environ = os.environ if environ is None else environ
    if environ.get("RAY_ADDRESS"):
        return environ["RAY_ADDRESS"]
    if external_ray or environ.get("K3_EXTERNAL_RAY", "").strip().lower() in {"1", "true", "yes", "on"}:
        return "auto"
    return None


@dataclass
class RayPlacement:
    """A connected Ray session holding the run's placement group; create actors with :meth:`create_actor`."""

    plan: PlacementPlan
    placement_group: Any
    rank_to_bundle: list[int]
    owns_connection: bool
    address: str | None
    _actors: list[Any] = field(default_factory=list)
    _closed: bool = False
    _previous_sigterm: Any = None

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, resolved: ResolvedConfig, *, timeout_s: float = PLACEMENT_TIMEOUT_S,
              object_store_memory: int | None = None) -> "RayPlacement":
        """Connect (or start Ray), check the cluster can hold ``resolved``'s placement, and place it."""
        return cls.start_plan(
            plan_placement(resolved),
            env=resolved.env,
            address=ray_address(resolved.args.external_ray),
            timeout_s=timeout_s,
            object_store_memory=object_store_memory,
        )

    @classmethod
    def start_plan(cls, plan: PlacementPlan, *, env: Mapping[str, str] | None = None, address: str | None = None,
                   timeout_s: float = PLACEMENT_TIMEOUT_S,
                   object_store_memory: int | None = None) -> "RayPlacement":
        """Like :meth:`start` for an explicit plan. ``address=None`` starts a local Ray sized for the plan."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        owns = False
        if not ray.is_initialized():
            runtime_env = {"env_vars": dict(env)} if env else None
            if address is None:
                ray.init(
                    address="local",
                    # Logical CPUs: enough for every bundle plus one for actors outside the group.
                    num_cpus=max(os.cpu_count() or 1, int(plan.total("CPU") + 0.999) + 1),
                    include_dashboard=False,
                    runtime_env=runtime_env,
                    object_store_memory=object_store_memory,
                    log_to_driver=True,
                )
            else:
                try:
                    ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
                except ConnectionError as e:
                    raise PlacementError(
                        f"no Ray cluster to join at {address!r} ({e}): start one with `ray start --head` on the "
                        "head node and `ray start --address HEAD:6379` on the others, or set RAY_ADDRESS; unset "
                        "K3_EXTERNAL_RAY / drop --external-ray to start a local Ray instead"
                    ) from None
            owns = True
        try:
            _check_capacity(plan, ray.cluster_resources(), address)
            pg = placement_group([dict(plan.bundle) for _ in range(plan.num_bundles)], strategy=plan.strategy,
                                 name=plan.name)
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(pg)
                raise PlacementError(
                    f"placement group of {plan.num_bundles} × {plan.bundle} ({plan.strategy}) not placed within "
                    f"{timeout_s:.0f} s; free resources now: {_free(ray.available_resources())}. Free the cluster "
                    "or lower the layout (--num-nodes / --num-gpus-per-node)"
                ) from None
            node_of = placement_group_table(pg)["bundles_to_node_id"]
            # Number ranks node by node so consecutive ranks (one TP group) share a node.
            rank_to_bundle = sorted(range(plan.num_bundles), key=lambda i: (node_of.get(i, ""), i))
        except BaseException:
            if owns:
                ray.shutdown()
            raise
        placement = cls(plan, pg, rank_to_bundle, owns, address)
        atexit.register(placement.shutdown)
        return placement

    # ------------------------------------------------------------------ actors
    def actor_options(self, rank: int, role: str = "trainer", share: float | None = None) -> dict[str, Any]:
        """Ray ``.options(...)`` placing an actor of ``role`` on rank ``rank``'s bundle with ``share`` of it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= rank < self.plan.num_bundles:
            raise IndexError(f"rank {rank}: the placement has ranks 0..{self.plan.num_bundles - 1}")
        if share is None:
            try:
                share = ROLE_SHARES[role]
            except KeyError:
                raise ValueError(f"role {role!r}: give share= or use one of {sorted(ROLE_SHARES)}") from None
        if not 0 < share <= 1:
            raise ValueError(f"share {share}: must be in (0, 1] of the rank's bundle")
        options: dict[str, Any] = {
            "num_cpus": self.plan.bundle.get("CPU", 0.0) * share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.rank_to_bundle[rank],
                placement_group_capture_child_tasks=True,
            ),
        }
        if "GPU" in self.plan.bundle:
            options["num_gpus"] = self.plan.bundle["GPU"] * share
        return options

    def create_actor(self, actor_cls: Any, rank: int, role: str = "trainer", *args: Any,
                     share: float | None = None, **kwargs: Any) -> Any:
        """Create ``actor_cls(*args, **kwargs)`` as a Ray actor on rank ``rank``; it is killed at shutdown.

        ``actor_cls`` may be a plain class or a ``@ray.remote`` one.
        """
        import ray

        if self._closed:
            raise RuntimeError("this placement was shut down")
        remote_cls = actor_cls if hasattr(actor_cls, "options") else ray.remote(actor_cls)
        handle = remote_cls.options(**self.actor_options(rank, role, share)).remote(*args, **kwargs)
        self._actors.append(handle)
        return handle

    # ------------------------------------------------------------------ cleanup
    def shutdown(self) -> None:
        """Kill this placement's actors, remove its placement group, disconnect. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        for handle in self._actors:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as e:  # an actor that already died is fine; anything else is worth a line
                log.warning("could not kill actor %s: %s", handle, e)
        self._actors.clear()
        try:
            remove_placement_group(self.placement_group)
        except Exception as e:
            log.warning("could not remove placement group %s: %s", self.plan.name, e)
        if self.owns_connection:
            ray.shutdown()

    def __enter__(self) -> "RayPlacement":
        # SIGTERM (ray job stop, Slurm) would end the process without unwinding; make it unwind so __exit__ runs.
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.shutdown()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _free(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU")) or "none"


def _check_capacity(plan: PlacementPlan, cluster: Mapping[str, float], address: str | None) -> None:
    where = f"the Ray cluster at {address}" if address else "the local Ray"
    for resource in plan.bundle:
        need, have = plan.total(resource), cluster.get(resource, 0.0)
        if need > have:
            hint = (
                "use --num-gpus-per-node 0 (CPU) with --model-variant tiny, or run where the GPUs are"
                if resource == "GPU"
                else "lower the layout or add nodes"
            )
            raise PlacementError(
                f"{where} has {have:g} {resource}; the run needs {need:g} ({plan.num_bundles} ranks × "
                f"{plan.bundle[resource]:g}): {hint}"
            )
