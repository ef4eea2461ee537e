"""What ``k3 train`` checks before it touches the run directory (and what ``--dry-run`` checks the same way).

:func:`check_inputs` in :mod:`k3.launch.train` says whether the files a run reads exist; the checks here go
further, so that a run which would fail in its first minute (after Ray, the engines and the model started) is
refused in one line before anything is written:

- every number a flag holds is finite (``--lr nan`` is refused; the parser refuses it on the command line, this
  catches a ``TrainArgs`` built in Python);
- ``--hf-checkpoint``'s ``config.json`` parses as a JSON object;
- the training and eval data are non-empty and every record parses (``k3.rl.data.records.read_records``: the
  loop's own validation, so what passes here loads there);
- optional dependencies a flag asks for are installed (``--enable-wandb``: wandb);
- ``--resume`` has a checkpoint to continue from (:func:`resume_refusal`).

Whether another live process holds the directory is :func:`k3.launch.run_lock.refuse_if_held`'s to say.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from k3.launch.args import ResolvedConfig
from k3.launch.parser import flag_name

__all__ = ["input_problems", "non_finite_flags", "resume_refusal"]


def input_problems(resolved: ResolvedConfig) -> list[str]:
    """Problems that stop the run before it starts, each one line (a data file's bad records follow it)."""
    a, data = resolved.args, resolved.data
    problems = non_finite_flags(resolved)
    config = Path(a.hf_checkpoint) / "config.json" if a.hf_checkpoint is not None else None
    if config is not None and config.is_file():
        problem = _json_object_problem(config)
        if problem is not None:
            problems.append(f"--hf-checkpoint {a.hf_checkpoint}: config.json {problem}: pass the directory of an "
                            "HF checkpoint")
    for what, path in (("training data", data.prompt_data), ("eval data", data.eval_prompt_data)):
        if path is not None and Path(path).is_file():  # a missing file is check_inputs' to report
            problem = _records_problem(Path(path))
            if problem is not None:
                problems.append(f"{what} {problem}")
    if a.enable_wandb and importlib.util.find_spec("wandb") is None:
        problems.append("--enable-wandb needs wandb, which is not installed: pip install 'k3-lora-rl[logging]', "
                        "or drop --enable-wandb")
    return problems


def non_finite_flags(resolved: ResolvedConfig) -> list[str]:
    """``--flag nan: must be a finite number`` for every flag whose number is NaN or infinite."""
    return [f"{flag_name(name)} {value}: must be a finite number" for name, value in vars(resolved.args).items()
            if isinstance(value, float) and not math.isfinite(value)]


def resume_refusal(resolved: ResolvedConfig, previous: dict | None) -> str | None:
    """Why ``--resume`` cannot continue this run (it has no adapter checkpoint yet), or None. ``previous`` is the
    config the run was started with: its ``save_interval`` is the one that did not come round."""
    if not resolved.args.resume:
        return None
    from k3.rl.resume import latest_checkpoint  # imports torch: only when there is a run to resume

    if latest_checkpoint(resolved.run_dir) is not None:
        return None
    interval = (previous or {}).get("save_interval", resolved.args.save_interval)
    return (f"--resume: {resolved.run_dir} has no adapter checkpoint to continue from (the run saves one every "
            f"--save-interval {interval} rollouts and had saved none): start the run again in a new --run-dir, "
            "or remove this one")


def _json_object_problem(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"is not JSON ({e})"
    return None if isinstance(value, dict) else f"holds a {type(value).__name__}, not a JSON object"


def _records_problem(path: Path) -> str | None:
    from k3.rl.data.records import DataError, read_records

    try:
        read_records(path)
    except DataError as e:
        return str(e)
    return None
