"""The order in which the colocated trainer and rollout engines hand memory to each other (recipe §5.3, §5.4).

Trainer and engines share every GPU, so around each training step one side gives its memory up before (``cpu``
peak: each side offloads before the other onloads, so the host briefly holds both host copies) or after (``gpu``
peak: the other side onloads first, so both briefly sit on the GPU and the host copies never overlap) the other
takes it. The steps below are data: ``k3.rl.loop`` runs them, the tests compare them with the recipe.

Engine steps go to every engine (``release_memory`` / ``resume_memory`` with SGLang's tags; both are idempotent
per tag on every engine). Trainer steps (``wake_up``, ``sleep``, ``offload_grad_buffer``: the recipe's
torch_memory_saver regions) are ``optional``: they run on a trainer that implements them, once per state change
(the loop skips a ``sleep`` of a sleeping trainer and a ``wake_up`` of an awake one); a trainer without them keeps
its memory resident and only the engine side moves.

The sync itself is always: ``pause_generation`` on every engine → ``update_weights`` on the trainer (every rank
returns only after its sync cleanup) → ``continue_generation`` on every engine (§5.4 steps 6–7: an engine that
resumed before the last rank's cleanup OOMed resuming its KV cache). Then :data:`AFTER_SYNC` (``onload_kv``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3.settings.colocate import PEAK_DEVICES

__all__ = ["AFTER_SYNC", "ENGINES", "KV_TAGS", "TRAINER", "Step", "after_train_steps",
           "before_first_sync_steps", "before_train_steps", "offload_tags", "startup_steps"]

ENGINES, TRAINER = "engines", "trainer"
KV_TAGS = ("kv_cache", "cuda_graph")


@dataclass(frozen=True)
class Step:
    """Call ``method`` on ``target`` (:data:`ENGINES`: all engines, with ``tags`` as the one argument when set;
    :data:`TRAINER`: no arguments). ``optional``: skipped on a trainer that does not implement ``method``."""

    target: str
    method: str
    tags: tuple[str, ...] = ()
    optional: bool = False


def _engines(method: str, tags: Sequence[str]) -> Step:
    return Step(ENGINES, method, tuple(tags))


def _trainer(method: str) -> Step:
    return Step(TRAINER, method, optional=True)


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


def before_first_sync_steps(peak: str, levels: Sequence[str]) -> list[Step]:
    """After the trainer was created, before the startup sync (adapter version 1). ``gpu`` skips the startup
    ``onload_weights``: the weights were never released, and resuming a never-released region is fatal in SGLang."""
    _check(peak)
    steps = [_trainer("sleep")]
    if peak == "cpu" and "weight" in levels:
        steps.append(_engines("resume_memory", ("weights",)))
    return steps


def before_train_steps(peak: str, levels: Sequence[str]) -> list[Step]:
    """After a rollout's generation, before the trainer's log-probs and steps (§5.4 steps 2–3 / the PK order)."""
    _check(peak)
    if peak == "cpu":
        return [_engines("release_memory", offload_tags(levels)), _trainer("wake_up")]
    steps = [_engines("release_memory", KV_TAGS), _trainer("wake_up")]
    if "weight" in levels:
        # The engine builds its host mirror only now, after the trainer's own host backup was consumed.
        steps.append(_engines("release_memory", ("weights",)))
    return steps


def after_train_steps(peak: str, levels: Sequence[str]) -> list[Step]:
    """After the training steps, up to the sync (§5.4 steps 4–5 / the PK order)."""
    _check(peak)
    weights = [_engines("resume_memory", ("weights",))] if "weight" in levels else []
    if peak == "cpu":
        return [_trainer("sleep"), *weights]
    # gpu: the engine weights come back while the trainer's params are still resident, then the trainer sleeps.
    return [_trainer("offload_grad_buffer"), *weights, _trainer("sleep")]
