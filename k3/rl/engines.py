"""A run's rollout engines from the loop's side: checked and started through their registered kind
(``k3.rollout.registry``: the loop never branches on the engine's name), connected to the trainer ranks that
feed them their adapters (recipe §4.5), and shut down."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from k3.rl import colocate as colocate_steps
from k3.rl.errors import TrainingError, last_line
from k3.rl.handles import LocalHandle, RayHandle, call_all
from k3.rl.trainers.group import is_trainer_group
from k3.rollout.errors import EngineUnavailableError
from k3.rollout.registry import ENGINES, engine_kind
from k3.settings.colocate import ColocateSettings
from k3.settings.parallel import ParallelLayout
from k3.settings.rollout import RolloutSettings
from k3.settings.worker import WorkerSpec

__all__ = ["BREAK_SYNC_ENV", "check_engine_available", "connect_engines", "feeding_ranks", "shutdown_engines",
           "start_engines"]

# The test hook of a broken adapter sync: an engine that acks every chunk but never activates a version.
BREAK_SYNC_ENV = "K3_TEST_BREAK_ADAPTER_SYNC"


def check_engine_available(engine: str, rollout: RolloutSettings, in_process: bool) -> None:
    """Stop at once, before Ray or any model starts, when the run's engine (registered as ``engine``) cannot run
    from here (its ``check_available``)."""
    try:
        engine_kind(engine).check_available(rollout, in_process=in_process)
    except EngineUnavailableError as e:
        raise TrainingError(str(e)) from None


def start_engines(engine: str, rollout: RolloutSettings, layout: ParallelLayout, colocate: ColocateSettings,
                  spec: WorkerSpec, placement: Any | None, sabotage_sync: bool = False) -> list[Any]:
    """The run's rollout engines (registered as ``engine``) as handles (in-process when ``placement`` is None,
    else Ray actors), started.

    An engine that takes its memory when it starts (``holds_memory_at_start``: SGLang's KV cache and graphs) then
    gives it up at once (recipe §5.4 startup: the trainer is created after the engines, into that room): ``cpu``
    peak everything of ``--offload-rollout-level``, ``gpu`` peak the KV cache and graphs."""
    kind = engine_kind(engine)
    if sabotage_sync and not kind.has_sabotage_hook:
        hooked = " or ".join(k.name for k in ENGINES.values() if k.has_sabotage_hook)
        raise TrainingError(f"the broken-sync test hook ({BREAK_SYNC_ENV}) is the {hooked} engine's")
    started = kind.start(rollout, layout, colocate, spec, placement, sabotage_sync=sabotage_sync)
    engines = [LocalHandle(e) if placement is None else RayHandle(e) for e in started]
    if kind.holds_memory_at_start:
        for step in colocate_steps.startup_steps(colocate.colocate_memory_peak_device, colocate.offload_rollout_level):
            call_all(engines, step.method, list(step.tags))
    return engines


def feeding_ranks(num_engines: int, ranks_per_engine: int, world_size: int) -> list[int]:
    """The trainer rank that sends engine ``k`` its adapters: the first rank on the engine's GPUs (recipe §4.5),
    ``k · ranks_per_engine``; raises ``TrainingError`` when the training ranks do not reach every engine."""
    if num_engines < 1 or ranks_per_engine < 1:
        raise TrainingError(f"{num_engines} engines of {ranks_per_engine} ranks each: both must be >= 1")
    feeders = [k * ranks_per_engine for k in range(num_engines)]
    if feeders[-1] >= world_size:
        raise TrainingError(f"{num_engines} rollout engines of {ranks_per_engine} GPUs each need "
                            f"{feeders[-1] + 1} trainer ranks to feed them; the trainer has {world_size}")
    return feeders


def connect_engines(trainer: Any, engines: Sequence[Any], ranks_per_engine: int = 1) -> None:
    """Open each engine's adapter socket and connect the trainer rank that feeds it (recipe §4.5: the first
    rank on the engine's GPUs, :func:`feeding_ranks`); under a trainer group every other rank exports without
    sending (``TrainerWorker.export_only``: the export is collective). A one-rank trainer feeds one engine.

    An engine that asks to be fed rank by rank (its ``rank_feed``: each engine rank's payload from the trainer rank
    on its GPU, the only way into an engine that spans nodes) then has every trainer rank join its feed
    (``TrainerWorker.join_rank_feeds``, collective)."""
    if not is_trainer_group(trainer):
        if len(engines) != 1:
            raise TrainingError(f"{len(engines)} rollout engines need one adapter sender each (the first trainer "
                                "rank on each engine's GPUs); this trainer is one rank, which feeds one engine")
        trainer.call("connect", *engines[0].call("listen"))
        feeders = [0]
    else:
        feeders = feeding_ranks(len(engines), ranks_per_engine, trainer.world_size)
        addresses = dict(zip(feeders, call_all(engines, "listen")))
        trainer.call_each([("connect", tuple(addresses[r])) if r in addresses else ("export_only", ())
                           for r in range(trainer.world_size)])
    feeds = [_rank_feed(engine) for engine in engines]
    for k, feed in enumerate(feeds):
        if feed is not None and feed.source_rank != feeders[k]:
            raise TrainingError(f"engine {k} would be fed from trainer rank {feed.source_rank}, but trainer rank "
                                f"{feeders[k]} is the one on its first GPU (its adapter socket's sender)")
    if any(feed is not None for feed in feeds):
        trainer.call("join_rank_feeds", [feed for feed in feeds if feed is not None])


def _rank_feed(engine: Any) -> Any:
    """The engine's ``RankFeed`` when it is fed rank by rank, else None (an engine without the notion)."""
    has = getattr(engine, "has", None)
    return engine.call("rank_feed") if has is not None and has("rank_feed") else None


def shutdown_engines(engines: Sequence[Any]) -> None:
    """Shut every engine down; a failure is reported as a warning (the run's own result or error matters more)."""
    for engine in engines:
        try:
            engine.call("shutdown")
        except Exception as e:  # noqa: BLE001 - a dead engine is already down; the run's own error matters more
            print(f"WARNING shutting a rollout engine down failed: {type(e).__name__}: {last_line(e)}", flush=True)
