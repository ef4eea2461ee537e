"""The resolved configuration of a run, as files and as a table.

- ``resolved_config.json``: every resolved name → value (:meth:`ResolvedConfig.to_dict`), plus ``env``.
- ``resolved_config.txt``: the same names in the layout of Megatron's argument dump, which is what the recipe's
  health check reads (``expert_model_parallel_size 8`` and friends)::

      ------------------------ arguments ------------------------
        context_parallel_size ........................... 2
        expert_model_parallel_size ...................... 8
      -------------------- end of arguments ---------------------

  one line per name, sorted case-insensitively, the name padded with dots to column 48 as Megatron pads it.
- an "Argument | Value" table of the flags (rich), printed at startup like the recipe's launcher prints its own.

Both files are written atomically (temporary file, then rename), so a reader never sees half a config.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from k3.launch.args import ResolvedConfig

__all__ = [
    "JSON_NAME",
    "TEXT_NAME",
    "format_argument_dump",
    "write_resolved_config",
    "read_resolved_config",
    "layout_summary",
    "print_args_table",
]

JSON_NAME = "resolved_config.json"
TEXT_NAME = "resolved_config.txt"
DUMP_TITLE = "arguments"
# Megatron pads every name with dots up to this column.
_DOT_COLUMN = 48


def format_argument_dump(values: dict[str, Any], title: str = DUMP_TITLE) -> str:
    """Megatron-style ``name ..... value`` lines for ``values`` (sorted by name, case-insensitively).

    Values print as ``str(value)``: ``True``, ``None``, ``1e-05``, ``['a', 'b']`` — Megatron's own rendering.
    A name of 48 characters or more still gets one dot so every line keeps the ``name <dots> value`` shape.
    """
    lines = [f"------------------------ {title} ------------------------"]
    body = [f"  {name} {'.' * max(_DOT_COLUMN - len(name), 1)} {value}" for name, value in values.items()]
    lines += sorted(body, key=str.lower)
    lines.append(f"-------------------- end of {title} ---------------------")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_resolved_config(resolved: ResolvedConfig, run_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``resolved_config.json`` and ``resolved_config.txt`` into ``run_dir`` (default: the run's own).

    Returns the two paths. The directory is created if needed.
    """
    run_dir = Path(run_dir) if run_dir is not None else resolved.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    values = resolved.to_dict()
    json_path, text_path = run_dir / JSON_NAME, run_dir / TEXT_NAME
    _write_atomic(json_path, json.dumps(values, indent=2, sort_keys=True) + "\n")
    # The environment is not an argument: it stays in the JSON only.
    _write_atomic(text_path, format_argument_dump({k: v for k, v in values.items() if k != "env"}))
    return json_path, text_path


def read_resolved_config(run_dir: str | Path) -> dict[str, Any]:
    """The name → value mapping a previous ``k3 train`` wrote into ``run_dir``."""
    path = Path(run_dir) / JSON_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no resolved config here (is this a k3 run directory?)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def layout_summary(resolved: ResolvedConfig) -> str:
    """One line: ``TP4 × CP2 × PP8 × DP1 = 64 ranks, EP8, ETP1; layers/stage 12×7 + 9; rollout 4 × TP16/EP1``."""
    lay = resolved.layout
    stages = list(lay.pipeline_layers)
    if len(set(stages)) == 1:
        split = f"{stages[0]}×{len(stages)}" if len(stages) > 1 else str(stages[0])
    else:
        split = f"{stages[0]}×{len(stages) - 1} + {stages[-1]}"
    device = "CPU" if not resolved.uses_gpus else "GPU"
    return (
        f"TP{lay.tensor_model_parallel_size} × CP{lay.context_parallel_size} × PP{lay.pipeline_model_parallel_size}"
        f" × DP{lay.data_parallel_size} = {lay.world_size} {device} rank{'s' if lay.world_size > 1 else ''}, "
        f"EP{lay.expert_model_parallel_size}, ETP{lay.expert_tensor_parallel_size}; layers/stage {split}; "
        f"rollout {lay.num_rollout_engines} × TP{lay.rollout_tp_size}/EP{lay.rollout_ep_size}"
    )


def print_args_table(resolved: ResolvedConfig, console: Any = None) -> None:
    """Print the resolved flags as an "Argument | Value" table, then the layout line and any notes."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    table = Table(title="k3 train", show_lines=False)
    table.add_column("Argument", style="cyan", no_wrap=True)
    table.add_column("Value", overflow="fold")
    for name, value in vars(resolved.args).items():
        shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        table.add_row(name, Text(shown))  # Text: a value like "[x]" is not rich markup
    console.print(table)
    console.print(Text(f"layout: {layout_summary(resolved)}"))
    for note in resolved.notes:
        console.print(Text("note: ", style="yellow") + Text(note))
