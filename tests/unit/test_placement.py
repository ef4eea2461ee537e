"""Ray placement: one bundle per training rank, trainer and engine of a rank in the same bundle, cleanup on every
exit. One local Ray session (a few seconds on 2 cores)."""

from __future__ import annotations

import pytest

from k3.launch.args import TrainArgs, resolve
from k3.launch.placement import (
    ROLE_SHARES,
    PlacementError,
    PlacementPlan,
    RayPlacement,
    plan_placement,
    ray_address,
)


def test_plan_for_tiny_on_cpu_and_full_on_the_cluster():
    tiny = plan_placement(resolve(TrainArgs(model_variant="tiny", run_id="t")))
    assert (tiny.num_bundles, tiny.bundle, tiny.strategy, tiny.name) == (1, {"CPU": 1.0}, "STRICT_PACK", "k3-t")
    full = plan_placement(resolve(TrainArgs(model_variant="full", num_nodes=16, num_gpus_per_node=4,
                                            pipeline_parallel_size=8, run_id="t")))
    assert (full.num_bundles, full.bundle, full.strategy) == (64, {"GPU": 1.0, "CPU": 1.0}, "PACK")
    assert full.total("GPU") == 64.0
    four = plan_placement(resolve(TrainArgs(run_id="t")))
    assert (four.num_bundles, four.strategy) == (8, "STRICT_PACK")


@pytest.mark.parametrize(
    "external, environ, address",
    [
        (False, {}, None),
        (False, {"RAY_ADDRESS": "10.0.0.1:6379"}, "10.0.0.1:6379"),
        (True, {}, "auto"),
        (False, {"K3_EXTERNAL_RAY": "1"}, "auto"),
        (True, {"RAY_ADDRESS": "ray://head:10001"}, "ray://head:10001"),
        (False, {"K3_EXTERNAL_RAY": "0"}, None),
    ],
)
def test_ray_address(external, environ, address):
    assert ray_address(external, environ) == address


def test_local_ray_colocates_trainer_and_engine_per_rank_and_cleans_up():
    import ray

    class Probe:
        def where(self):
            import os

            ctx = ray.get_runtime_context()
            return ctx.get_placement_group_id(), ctx.get_assigned_resources(), os.environ.get("K3_PLACEMENT_PROBE")

    plan = PlacementPlan(num_bundles=2, bundle={"CPU": 1.0}, strategy="STRICT_PACK", name="k3-test")
    assert not ray.is_initialized()
    with pytest.raises(RuntimeError, match="boom"):
        with RayPlacement.start_plan(plan, env={"K3_PLACEMENT_PROBE": "yes"},
                                     object_store_memory=100 * 1024**2) as placement:
            assert placement.owns_connection and placement.address is None
            assert sorted(placement.rank_to_bundle) == [0, 1]
            options = placement.actor_options(1, "engine")
            assert options["num_cpus"] == pytest.approx(ROLE_SHARES["engine"]) and "num_gpus" not in options
            assert options["scheduling_strategy"].placement_group_bundle_index == placement.rank_to_bundle[1]

            actors = [placement.create_actor(Probe, rank, role) for rank in range(2) for role in ROLE_SHARES]
            reports = ray.get([a.where.remote() for a in actors])
            pg_id = placement.placement_group.id.hex()
            assert {r[0] for r in reports} == {pg_id}
            assert all(r[1] == {"CPU": pytest.approx(0.4)} and r[2] == "yes" for r in reports)
            # Each bundle holds exactly its rank's trainer and engine: 1 − 0.4 − 0.4 left in both.
            free = ray.available_resources()
            for bundle in range(2):
                assert free[f"CPU_group_{bundle}_{pg_id}"] == pytest.approx(0.2)

            # A second placement too big for the cluster fails with what is missing and keeps this session.
            too_big = PlacementPlan(num_bundles=64, bundle={"GPU": 1.0, "CPU": 1.0}, strategy="PACK")
            with pytest.raises(PlacementError, match=r"the local Ray has 0 GPU; the run needs 64 \(64 ranks × 1\): "
                                                     r"use --num-gpus-per-node 0 \(CPU\)"):
                RayPlacement.start_plan(too_big)
            assert ray.is_initialized()

            with pytest.raises(IndexError, match=r"rank 2: the placement has ranks 0..1"):
                placement.actor_options(2)
            with pytest.raises(ValueError, match=r"role 'critic': give share= or use one of"):
                placement.actor_options(0, "critic")
            raise RuntimeError("boom")
    assert not ray.is_initialized()
    placement.shutdown()  # a second shutdown is a no-op
    with pytest.raises(RuntimeError, match="shut down"):
        placement.create_actor(Probe, 0)


@pytest.mark.gpu
def test_trainer_and_engine_of_a_rank_share_its_gpu():
    import ray

    class GpuProbe:
        def gpu(self):
            return ray.get_gpu_ids()

    resolved = resolve(TrainArgs(model_variant="tiny", num_gpus_per_node=1, run_id="gpu"))
    with RayPlacement.start(resolved) as placement:
        assert placement.plan.bundle == {"GPU": 1.0, "CPU": 1.0}
        assert placement.actor_options(0, "trainer")["num_gpus"] == pytest.approx(0.4)
        trainer, engine = (placement.create_actor(GpuProbe, 0, role) for role in ("trainer", "engine"))
        assert ray.get(trainer.gpu.remote()) == ray.get(engine.gpu.remote())
        assert len(ray.get(trainer.gpu.remote())) == 1
    assert not ray.is_initialized()
