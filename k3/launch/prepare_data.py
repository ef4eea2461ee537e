"""`k3 prepare-data`: put a task's prompts under the data dir in the recipe's layout.

The command line only; fetching, validating and laying out the data is ``k3.rl.data``'s.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["prepare_data"]


class Task(str, Enum):
    dapo_math = "dapo-math"
    gsm8k = "gsm8k"
    arith = "arith"


def prepare_data(
    task: Annotated[
        Task,
        typer.Option(
            help="dapo-math: dapo-math-17k (train) + aime-2024 (eval); gsm8k: gsm8k "
            "train/test; arith: the generated smoke task (no download)."
        ),
    ],
    data_dir: Annotated[
        Path,
        typer.Option(help="Where the datasets go, one folder each (<data-dir>/dapo-math-17k/dapo-math-17k.jsonl, …)."),
    ],
    from_local: Annotated[
        Path | None,
        typer.Option(
            help="Import files you already have instead of downloading: "
            "a folder holding dapo-math-17k.jsonl, aime-2024.jsonl, "
            "gsm8k's train/test.parquet (or earlier `hf download` "
            "folders)."
        ),
    ] = None,
    force: Annotated[bool, typer.Option(help="Fetch again even when valid files are already in place.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the generated arith task.")] = 0,
) -> None:
    """Download (through huggingface_hub) or import a task's datasets, validate every record, and lay them out
    as the recipe expects. Records are JSON lines with `prompt` and `label`. Without network it says exactly
    what to fetch and where to put it."""
    from k3.rl.data.prepare import prepare_data as prepare
    from k3.rl.data.records import DataError

    try:
        result = prepare(task.value, data_dir, from_local, force=force, seed=seed)
    except DataError as e:
        typer.echo(f"k3 prepare-data: {e}", err=True)
        raise typer.Exit(1) from None
    for f in result.files:
        typer.echo(f"{f.path}  {f.records} records  ({f.source})")
    typer.echo(
        f"task {task.value}: train {result.paths.train}, eval {result.paths.eval} "
        f"(logged as eval/{result.paths.eval_name})"
    )
