"""Readers: turn a run's files into :class:`~harness.run_data.RunData`.

``open_source(path)`` picks the reader from what ``path`` is:

==========================================  ==========================================================
path                                        reader
==========================================  ==========================================================
directory with ``metrics.jsonl`` / config   :class:`~harness.readers.run_dir.RunDirSource` (live-followable)
``metrics.jsonl`` itself                    the run directory it is in
directory or file of ``events.out.tfevents`` :class:`~harness.readers.tensorboard.TensorBoardSource`
W&B offline run (``offline-run-*``, ``.wandb``) :class:`~harness.readers.wandb_offline.WandbOfflineSource`
any other file                              :class:`~harness.readers.recipe_log.RecipeLogSource` (stdout log)
==========================================  ==========================================================

Every source has ``kind`` and ``read(run, final=False) -> events added``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from harness.readers.errors import ReaderError, ReaderUnavailable
from harness.run_data import RunData

__all__ = ["Source", "open_source", "read_run", "expected_input", "ReaderError", "ReaderUnavailable", "LIVE_KINDS"]

# Sources that grow while a run writes them (and so can be watched).
LIVE_KINDS = ("run_dir", "recipe_log")


class Source(Protocol):
    kind: str

    def read(self, run: RunData, final: bool = False) -> int: ...


def open_source(path: str | Path) -> Source:
    """The reader for ``path`` (see the module doc); :class:`ReaderError` when there is nothing to read."""
    from harness.readers.recipe_log import RecipeLogSource
    from harness.readers.run_dir import METRICS_NAME, RunDirSource, is_run_dir
    from harness.readers.tensorboard import TensorBoardSource, is_tensorboard
    from harness.readers.wandb_offline import WandbOfflineSource, is_wandb_offline

    path = Path(path)
    if not path.exists():
        raise ReaderError(f"{path}: no such file or directory")
    if path.is_file() and path.name == METRICS_NAME:
        return RunDirSource(path.parent)
    if is_run_dir(path):
        return RunDirSource(path)
    if is_wandb_offline(path):
        return WandbOfflineSource(path)
    if is_tensorboard(path):
        return TensorBoardSource(path)
    if path.is_file():
        return RecipeLogSource(path)
    raise ReaderError(f"{path}: a directory with no metrics.jsonl, resolved_config.*, TensorBoard event files "
                      "or W&B offline run in it")


def read_run(path: str | Path, finished: bool | None = None, now: float | None = None) -> RunData:
    """Read everything at ``path`` now.

    ``finished``: None = what the source says (a run directory's ``status`` event; logs, TensorBoard and W&B
    files are post-hoc and count as finished); True / False force it (False: still running, so absent data is
    PENDING rather than MISSING). ``now``: the unix time of the read (default: the clock), from which the time
    since the run's last event is told.
    """
    source = open_source(path)
    run = RunData(source=str(path), kind=source.kind)
    source.read(run, final=True)
    run.read_at = time.time() if now is None else now
    if finished is not None:
        run.finished = finished
    elif source.kind != "run_dir":
        run.finished = True
    return run


def expected_input(kind: str) -> str:
    """What a source of ``kind`` should have held, for the one-line error when nothing in it was recognised."""
    recipe = ("the public recipe's stdout log (lines such as 'rollout N: {…}', 'perf N: {…}', "
              "'[Rank R] Memory-Usage after update_weights: {…}', 'LoRA weight version N sent in M chunks', the "
              "Megatron argument dump)")
    return {
        "run_dir": "a k3 run directory: metrics.jsonl events (docs/RUN_DIRECTORY.md) or resolved_config.json / .txt",
        "recipe_log": f"{recipe}, or a k3 run directory (metrics.jsonl)",
        "tensorboard": "TensorBoard event files with scalars",
        "wandb": "a W&B offline run with history rows or config",
    }.get(kind, f"a run directory or {recipe}")
