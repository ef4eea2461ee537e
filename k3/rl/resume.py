"""A run's adapter checkpoints and what ``--resume`` loads from them.

``<run_dir>/adapters/rollout_NNNNNN/`` holds, after the rollout ``NNNNNN``:

- ``adapter_config.json`` and ``adapter_model.safetensors``: the adapters as PEFT files (``k3.lora.export``);
- ``trainer_state.pt`` (:data:`STATE_NAME`): the loop's and the optimizer's state, a ``torch.save`` of a dict of
  plain data and tensors only, loaded with ``torch.load(weights_only=True)`` (a file holding any other Python
  object is refused, so a planted file cannot run code on ``--resume``). It must hold:

  - ``rollout_id``: int >= 0, the last rollout the checkpoint includes (``--resume`` continues with the next);
  - ``version``: int >= 0, the adapter version the trainer had sent when it was saved;
  - the trainer's optimizer state (``TrainerWorker.optimizer_state``). One rank: ``optimizer`` (the optimizer's
    ``state_dict()`` of tensors, numbers, strings and lists: a dict, or for megatron's chained optimizer a list of
    dicts, one per optimizer it chains), ``steps`` (int >= 0, optimizer steps taken) and ``backend``
    (``"torch"`` or ``"megatron"``; absent: ``torch``) and ``optimizer_kind`` (``"adam"`` or ``"sgd"``, the
    optimizer that wrote it, which a resume must run too; absent: ``adam``); the megatron backend adds ``parallel``
    ([TP, EP, PP, CP]) and ``dp``. Several ranks (``k3.rl.trainers.group.merge_rank_states``):
    rank 0's ``backend``, ``parallel``, ``dp``, ``steps``, the ``world_size`` and ``ranks``, the list of every
    rank's one-rank state above, in rank order.

Across a resume the loop's counters continue (docs/RUN_DIRECTORY.md, "Resumed runs"): the adapter version
from the state's ``version`` (the resumed attempt's startup sync serves ``version + 1``), the sync index from
the run's own ``metrics.jsonl`` (:func:`next_sync_index`: the killed attempt may have synced after its last
checkpoint, and those indices are taken).

A save is atomic (a temp folder renamed into place, ``latest`` written last), and checks that the state it
wrote loads back as above; :func:`load_checkpoint_state` checks every file before anything is loaded into the
trainer. Either refuses with one line naming the file and what is wrong (:class:`~k3.rl.errors.TrainingError`).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from k3.lora.export import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from k3.rl.errors import TrainingError, last_line
from k3.rl.trainers.group import RANKS_KEY, is_trainer_group, merge_rank_states, split_rank_states
from k3.settings.train import OPTIMIZERS, optimizer_kind_problem

__all__ = ["STATE_NAME", "latest_checkpoint", "next_sync_index", "load_checkpoint_state", "load_optimizer_state",
           "load_trainer_state", "optimizer_state", "remove_stale_temp_dirs", "save_checkpoint", "saved_optimizer_kind",
           "trainer_state_problem"]

STATE_NAME = "trainer_state.pt"
_RESUME_HINT = "; resume from an earlier checkpoint by removing this one, or start a fresh --run-dir"


# ------------------------------------------------------------------------------------------------ saving
def save_checkpoint(run_dir: str | Path, trainer: Any, rollout_id: int, version: int) -> Path:
    """Adapter (PEFT files) + optimizer state + loop state of ``rollout_id`` into
    ``<run_dir>/adapters/rollout_NNNNNN``, atomically: a temp dir renamed into place. ``trainer`` is the run's
    trainer handle (one rank or a group: every rank takes part, rank 0 writes the adapter files)."""
    root = Path(run_dir) / "adapters"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"rollout_{rollout_id:06d}"
    tmp = root / f".tmp-rollout_{rollout_id:06d}-{os.getpid()}"
    remove_stale_temp_dirs(root)
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.call("save_adapter", str(tmp))  # collective under megatron; rank 0 writes the files
    state = {"rollout_id": rollout_id, "version": version, **optimizer_state(trainer)}
    torch.save(state, tmp / STATE_NAME)
    # What --resume will load, checked now (memory-mapped: the tensors are not read), so a state that would not
    # load safely fails this save instead of the resume.
    load_trainer_state(tmp / STATE_NAME, mmap=True, hint="; a trainer state must hold only plain data and tensors")
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    (root / "latest").write_text(final.name + "\n")
    return final


def remove_stale_temp_dirs(adapters_dir: str | Path) -> list[Path]:
    """Remove the ``.tmp-rollout_*-<pid>`` folders of saves whose process is gone (a killed ``k3 train``);
    a folder of a live process is kept (it may be mid-save). Returns what was removed."""
    removed = []
    root = Path(adapters_dir)
    for tmp in root.glob(".tmp-rollout_*-*") if root.is_dir() else []:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _fsync_dir(path: Path) -> None:
    for p in [*path.iterdir(), path] if path.is_dir() else [path]:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------------ loading
def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete adapter checkpoint of a run (temp folders of an interrupted save are ignored)."""
    root = Path(run_dir) / "adapters"
    done = sorted(p for p in root.glob("rollout_*") if (p / STATE_NAME).exists()) if root.is_dir() else []
    return done[-1] if done else None


def next_sync_index(run_dir: str | Path) -> int:
    """The first ``sync`` index no earlier attempt used: one past the highest ``sync`` of any event in
    ``<run_dir>/metrics.jsonl`` (memory readings included), 0 when there is none. Lines that do not parse (a
    line cut by a kill) are skipped: they are the harness's to report."""
    path = Path(run_dir) / "metrics.jsonl"
    highest = -1
    if not path.is_file():
        return 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            sync = event.get("sync") if isinstance(event, dict) else None
            if isinstance(sync, int) and not isinstance(sync, bool) and sync > highest:
                highest = sync
    return highest + 1


def load_checkpoint_state(checkpoint: str | Path) -> dict[str, Any]:
    """Check that every file of an adapter checkpoint loads, and return its ``trainer_state.pt``.

    Checked before anything is loaded into the trainer, so a damaged checkpoint fails ``--resume`` up front:
    ``adapter_config.json`` must be JSON, ``adapter_model.safetensors`` must have a valid header whose tensors
    fit in the file (a truncated write fails here), and ``trainer_state.pt`` must hold a trainer state (see the
    module docstring; :func:`load_trainer_state`). Raises ``TrainingError`` naming the file.
    """
    checkpoint = Path(checkpoint)
    config, weights, state_path = (checkpoint / ADAPTER_CONFIG_NAME, checkpoint / ADAPTER_WEIGHTS_NAME,
                                   checkpoint / STATE_NAME)
    for path in (config, weights, state_path):
        if not path.is_file():
            raise TrainingError(f"checkpoint {checkpoint}: {path.name} is missing{_RESUME_HINT}")
    try:
        json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TrainingError(f"checkpoint file {config} is corrupted (not JSON: {e}){_RESUME_HINT}") from e
    try:
        with safe_open(str(weights), framework="pt") as f:
            if not list(f.keys()):
                raise ValueError("it holds no tensors")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for every kind of damage
        raise TrainingError(f"checkpoint file {weights} is corrupted ({type(e).__name__}: {e}){_RESUME_HINT}") from e
    return load_trainer_state(state_path)


def load_trainer_state(path: str | Path, *, mmap: bool = False, hint: str = _RESUME_HINT) -> dict[str, Any]:
    """The trainer state in ``path`` (``trainer_state.pt``), loaded with ``torch.load(weights_only=True)`` onto
    the CPU and checked to hold what the module docstring lists. ``mmap``: map the tensors instead of reading
    them (a check of the file's structure). Raises ``TrainingError``, one line naming the file and what is
    wrong, ``hint`` appended: for a file that is not a torch file, one that holds any Python object besides
    plain data and tensors (refused unrun: unpickling it could run code), or a state that misses a key."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as e:  # the weights-only unpickler refused the file
        raise TrainingError(f"checkpoint file {path} {_refusal(e)}{hint}") from e
    except Exception as e:  # noqa: BLE001 - torch.load fails with zip, OS and runtime errors alike
        raise TrainingError(f"checkpoint file {path} is corrupted ({type(e).__name__}: {last_line(e)}){hint}") from e
    problem = trainer_state_problem(state)
    if problem is not None:
        raise TrainingError(f"checkpoint file {path} is corrupted ({problem}){hint}")
    return state


def _refusal(error: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler found, in one line: an object it will not rebuild (a ``GLOBAL``: a
    class or function, such as a pickle planted to run a command) or bytes that are no pickle it reads."""
    text = str(error)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found is not None:
        return (f"is refused: it holds a Python object that is not plain data or a tensor ({found.group(1)}); a "
                "trainer state never does, and unpickling it could run code")
    found = re.search(r"Unsupported operand \S+", text) or re.search(r"WeightsUnpickler error: *(\S.*)", text)
    detail = found.group(found.lastindex or 0).strip() if found is not None else last_line(error)
    return f"is corrupted (not a torch file of plain data and tensors: {detail})"


def trainer_state_problem(state: Any) -> str | None:
    """What keeps ``state`` from being a trainer state (the module docstring's keys and types), or None."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict"
    if "rollout_id" not in state:
        return "no rollout_id in it"
    for key in ("rollout_id", "version"):
        if not _is_count(state.get(key)):
            return f"{key} is {state.get(key)!r}, not an integer >= 0"
    if RANKS_KEY not in state:
        return _optimizer_problem(state, "")
    ranks = state[RANKS_KEY]
    if not isinstance(ranks, list) or not ranks:
        return f"'{RANKS_KEY}' is {type(ranks).__name__}, not a list of the ranks' optimizer states"
    for rank, rank_state in enumerate(ranks):
        problem = _optimizer_problem(rank_state, f"rank {rank}'s ")
        if problem is not None:
            return problem
    return None


def _optimizer_problem(state: Any, whose: str) -> str | None:
    if not isinstance(state, dict):
        return f"{whose}optimizer state is a {type(state).__name__}, not a dict"
    if "optimizer" not in state:
        return f"no {whose}optimizer state in it (no 'optimizer' key)"
    optimizer = state["optimizer"]
    if not (isinstance(optimizer, dict) or isinstance(optimizer, list) and all(isinstance(o, dict) for o in optimizer)):
        return (f"{whose}'optimizer' is a {type(optimizer).__name__}, not an optimizer's state dict (or a list of "
                "them)")
    if not _is_count(state.get("steps")):
        return f"{whose}'steps' is {state.get('steps')!r}, not an integer >= 0"
    if state.get("optimizer_kind", "adam") not in OPTIMIZERS:
        return f"{whose}'optimizer_kind' is {state.get('optimizer_kind')!r}, not one of {', '.join(OPTIMIZERS)}"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------------------------------------ optimizer state
def optimizer_state(trainer: Any) -> dict[str, Any]:
    """The trainer's optimizer state for a checkpoint: a group's ranks merged (``merge_rank_states``)."""
    if not is_trainer_group(trainer):
        return trainer.call("optimizer_state")
    return merge_rank_states(trainer.call("optimizer_state"))


def saved_optimizer_kind(state: dict[str, Any]) -> str:
    """The optimizer that wrote a checkpoint's optimizer state: its (first rank's) ``optimizer_kind``; a state
    without one predates SGD and is Adam's."""
    ranks = state.get(RANKS_KEY)
    first = ranks[0] if isinstance(ranks, list) and ranks else state
    return first.get("optimizer_kind", "adam")


def load_optimizer_state(trainer: Any, state: dict[str, Any], optimizer: str | None = None) -> None:
    """Give every rank its own part of a checkpoint's optimizer state (``split_rank_states``); a checkpoint of
    another rank count, or (``optimizer``: the run's, ``adam`` / ``sgd``) one written by the other optimizer, raises
    ``TrainingError`` (one line) before any rank loads anything."""
    if optimizer is not None:
        problem = optimizer_kind_problem(saved_optimizer_kind(state), optimizer)
        if problem is not None:
            raise TrainingError(f"--resume: {problem}")
    group = is_trainer_group(trainer)
    try:
        states = split_rank_states(state, trainer.world_size if group else 1)
    except ValueError as e:
        raise TrainingError(f"--resume: {e}") from None
    if group:
        trainer.call_each([("load_optimizer_state", (s,)) for s in states])
    else:
        trainer.call("load_optimizer_state", states[0])
