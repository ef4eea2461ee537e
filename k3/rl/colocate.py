"""The order in which the colocated trainer and rollout engines hand memory to each other (recipe §5.3, §5.4).

Trainer and engines share every GPU, so around each training step one side gives its memory up before (``cpu``
peak: each side offloads before the other onloads, so the host briefly holds both host copies) or after (``gpu``
peak: the other side onloads first, so both briefly sit on the GPU and the host copies never overlap) the other
takes it. The steps below are data: ``k3.rl.loop`` runs them, the tests compare them with the recipe.

Engine steps go to every engine (``release_memory`` / ``resume_memory`` with SGLang's tags; both are idempotent
per tag on every engine). Trainer steps (``wake_up``, ``sleep``, ``offload_grad_buffer``, ``clear_memory``: the
recipe's torch_memory_saver regions, ``k3.rl.trainers.memory_regions``) run only with ``--offload-train``; then they
are required (a trainer without them stops the run before it starts) and idempotent on the trainer (the recipe's
state flags). Without ``--offload-train`` the trainer keeps its memory resident and only the engine side moves, in
the same order.

The sync itself is always: ``pause_generation`` on every engine → ``update_weights`` on the trainer (every rank
returns only after its sync cleanup; with ``--offload-train`` the trainer is asleep and the exporter reads its
adapters from the memory saver's backups) → ``continue_generation`` on every engine (§5.4 steps 6–7: an engine that
resumed before the last rank's cleanup OOMed resuming its KV cache). Then :data:`AFTER_SYNC` (``onload_kv``).

The orders, with ``weight`` in ``--offload-rollout-level`` (the recipe's lists, §5.3–5.4):

* startup (an engine that holds memory at start): ``cpu``: release all → create trainer → sleep → resume
  weights → sync → resume KV. ``gpu``: release KV → create trainer → sleep → sync → resume KV (the weights were
  never released: no startup onload). An engine that allocates per call: create trainer → sleep → sync.
* per rollout, ``cpu``: generate → release all → wake_up → train → sleep → resume weights → sync → resume KV.
* per rollout, ``gpu``: generate → release KV → wake_up → release weights → train → clear_memory →
  offload_grad_buffer → resume weights → sleep → sync → resume KV.

Two differences from the recipe's loop, both deliberate: every rollout ends with a sync, the last one too (the
recipe skips the final offload and update; the harness counts one version per rollout), and the adapter checkpoint
is written after the sync and the eval, with the trainer asleep (the recipe saves right after training): the
exporter reads the adapters from the memory saver's backups, and the optimizer state is outside its regions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3.settings.colocate import PEAK_DEVICES

__all__ = ["AFTER_SYNC", "ENGINES", "KV_TAGS", "TRAINER", "TRAINER_METHODS", "Step", "after_train_steps",
           "before_first_sync_steps", "before_train_steps", "offload_tags", "startup_steps"]

ENGINES, TRAINER = "engines", "trainer"
KV_TAGS = ("kv_cache", "cuda_graph")
# What a trainer must implement under --offload-train (each returns its memory readings, [] when nothing moved).
TRAINER_METHODS = ("sleep", "wake_up", "offload_grad_buffer", "clear_memory")


@dataclass(frozen=True)
class Step:
    """Call ``method`` on ``target`` (:data:`ENGINES`: all engines, with ``tags`` as the one argument when set;
    :data:`TRAINER`: no arguments, one of :data:`TRAINER_METHODS`)."""

    target: str
    method: str
    tags: tuple[str, ...] = ()


def _engines(method: str, tags: Sequence[str]) -> Step:
    return Step(ENGINES, method, tuple(tags))


def _trainer(method: str) -> Step:
    return Step(TRAINER, method)


def _only(steps: list[Step], offload_train: bool) -> list[Step]:
    """``steps`` less the trainer's when the trainer keeps its memory resident (no ``--offload-train``)."""
    return steps if offload_train else [s for s in steps if s.target != TRAINER]


AFTER_SYNC: tuple[Step, ...] = (_engines("resume_memory", KV_TAGS),)  # §5.4 step 8: onload_kv


def _check(peak: str) -> None:
    if peak not in PEAK_DEVICES:
        raise ValueError(f"colocate_memory_peak_device={peak!r}: expected one of {PEAK_DEVICES}")


def offload_tags(levels: Sequence[str]) -> tuple[str, ...]:
    """Engine memory tags released for training under ``--offload-rollout-level`` (``kv_cache`` is always in,
    ``weight`` adds ``weights``)."""
    return KV_TAGS + (("weights",) if "weight" in levels else ())


def startup_steps(peak: str, levels: Sequence[str]) -> list[Step]:
    """Right after the engines start, before the trainer is created (it loads its checkpoint into that room).
    ``gpu``: only the KV cache and CUDA graphs go; the engine weights stay resident, since their host mirror could
    not coexist with the trainer's checkpoint load on the host."""
    _check(peak)
    return [_engines("release_memory", offload_tags(levels) if peak == "cpu" else KV_TAGS)]


def before_first_sync_steps(peak: str, levels: Sequence[str], offload_train: bool = True,
                            engines_released: bool = True) -> list[Step]:
    """After the trainer was created (it loaded its checkpoint awake), before the startup sync (adapter version 1):
    the trainer sleeps, and ``cpu`` restores the engine weights released at start. ``gpu`` skips the startup
    ``onload_weights``: the weights were never released, and resuming a never-released region is fatal in SGLang.
    ``engines_released``: the engines gave memory up at start (:func:`startup_steps`); an engine that allocates per
    call did not, and gets no engine step here."""
    _check(peak)
    steps = [_trainer("sleep")]
    if engines_released and peak == "cpu" and "weight" in levels:
        steps.append(_engines("resume_memory", ("weights",)))
    return _only(steps, offload_train)


def before_train_steps(peak: str, levels: Sequence[str], offload_train: bool = True) -> list[Step]:
    """After a rollout's generation, before the trainer's log-probs and steps (§5.4 steps 2–3 / the PK order)."""
    _check(peak)
    if peak == "cpu":
        return _only([_engines("release_memory", offload_tags(levels)), _trainer("wake_up")], offload_train)
    steps = [_engines("release_memory", KV_TAGS), _trainer("wake_up")]
    if "weight" in levels:
        # The engine builds its host mirror only now, after the trainer's own host backup was consumed.
        steps.append(_engines("release_memory", ("weights",)))
    return _only(steps, offload_train)


def after_train_steps(peak: str, levels: Sequence[str], offload_train: bool = True) -> list[Step]:
    """After the training steps, up to the sync (§5.4 steps 4–5 / the PK order)."""
    _check(peak)
    weights = [_engines("resume_memory", ("weights",))] if "weight" in levels else []
    if peak == "cpu":
        return _only([_trainer("sleep"), *weights], offload_train)
    # gpu: the trainer frees what it can while its params stay resident, the engine weights come back, then the
    # trainer sleeps (its host backup is taken after the engine's mirror was consumed).
    return _only([_trainer("clear_memory"), _trainer("offload_grad_buffer"), *weights, _trainer("sleep")],
                 offload_train)
