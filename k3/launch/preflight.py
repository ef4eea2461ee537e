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
- ``--resume`` has a checkpoint to continue from (:func:`resume_refusal`);
- the checkpoints: what ``--hf-checkpoint`` holds (native MXFP4 or BF16, whole), whether the backend can take it,
  and whether ``--ref-load`` holds the same model (:mod:`k3.launch.checkpoint_checks`);
- the backend fits the layout: ``--backend torch`` trains on one rank;
- a flag given for a backend or engine the run does not use (``--ref-load`` with ``--backend torch``,
  ``--sglang-max-total-tokens`` with the embedded engine, …: the registry's ``only_with``,
  :mod:`k3.launch.resolved_keys`) is refused, since nothing would apply it;
- the run directory can be created and written.

Whether another live process holds the directory is :func:`k3.launch.run_lock.refuse_if_held`'s to say.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from k3.launch.args import ResolvedConfig, TrainArgs, flag_was_given
from k3.launch.checkpoint_checks import check_checkpoints
from k3.launch.parser import flag_name
from k3.launch.resolved_keys import REGISTRY, condition_holds

__all__ = ["Preflight", "run_checks", "input_problems", "non_finite_flags", "resume_refusal", "unused_flags",
           "backend_problems", "run_dir_problem"]


@dataclass
class Preflight:
    """What the checks found: ``problems`` stop the run (one line each, all of them together); ``notes`` are
    printed and do not; ``facts`` say what each checkpoint is and who loads it (the dry run prints them)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)


def run_checks(resolved: ResolvedConfig) -> Preflight:
    """Every check of this module on ``resolved`` (the existence of its inputs is ``check_inputs``')."""
    checkpoints = check_checkpoints(resolved)
    problems = input_problems(resolved, checkpoint_problems=checkpoints.problems)
    return Preflight(problems, checkpoints.notes, checkpoints.facts)


def input_problems(resolved: ResolvedConfig, checkpoint_problems: list[str] | None = None) -> list[str]:
    """Problems that stop the run before it starts, each one line (a data file's bad records follow it).
    ``checkpoint_problems``: :func:`~k3.launch.checkpoint_checks.check_checkpoints`' when already made."""
    a, data = resolved.args, resolved.data
    problems = non_finite_flags(resolved) + unused_flags(resolved) + backend_problems(resolved)
    config = Path(a.hf_checkpoint) / "config.json" if a.hf_checkpoint is not None else None
    if config is not None and config.is_file():
        problem = _json_object_problem(config)
        if problem is not None:
            problems.append(f"--hf-checkpoint {a.hf_checkpoint}: config.json {problem}: pass the directory of an "
                            "HF checkpoint")
    if checkpoint_problems is None:
        checkpoint_problems = check_checkpoints(resolved).problems
    problems += checkpoint_problems
    for what, path in (("training data", data.prompt_data), ("eval data", data.eval_prompt_data)):
        if path is not None and Path(path).is_file():  # a missing file is check_inputs' to report
            problem = _records_problem(Path(path))
            if problem is not None:
                problems.append(f"{what} {problem}")
    if a.enable_wandb and importlib.util.find_spec("wandb") is None:
        problems.append("--enable-wandb needs wandb, which is not installed: pip install 'k3-lora-rl[logging]', "
                        "or drop --enable-wandb")
    problem = run_dir_problem(resolved.run_dir)
    if problem is not None:
        problems.append(problem)
    return problems


_FLAGS = {f.name for f in dataclasses.fields(TrainArgs)}


def unused_flags(resolved: ResolvedConfig) -> list[str]:
    """``--flag X is applied only with --backend megatron (this run: --backend torch): …`` for every flag given a
    value although the part that applies it does not run (the registry's ``only_with``)."""
    a, values = resolved.args, resolved.to_dict()
    out = []
    for name, entry in REGISTRY.items():
        if name not in _FLAGS or entry.only_with is None or condition_holds(entry, values):
            continue
        if not flag_was_given(a, name):
            continue  # left at its default: the dump shows it off, nothing to refuse
        key, wanted = entry.only_with
        need = flag_name(key) if wanted is True else f"{flag_name(key)} {wanted}"
        now = f"no {flag_name(key)}" if wanted is True else f"{flag_name(key)} {values.get(key)}"
        out.append(f"{flag_name(name)} {getattr(a, name)} is applied only with {need} (this run: {now}): add "
                   f"{need}, or drop {flag_name(name)}")
    return out


def backend_problems(resolved: ResolvedConfig) -> list[str]:
    """What the chosen trainer backend cannot run: the torch backend trains on one rank. (Whether this host has the
    megatron backend's CUDA GPU is the loop's to say when the run starts: a dry run may validate a cluster's launch
    on a machine without them.)"""
    a, layout = resolved.args, resolved.layout
    out = []
    if a.backend == "torch" and (layout.world_size or 1) > 1:
        out.append(f"--backend torch trains on one rank, but this layout has {layout.world_size} training ranks "
                   f"({a.num_nodes} node(s) × {a.num_gpus_per_node} GPUs): add --backend megatron")
    return out


def run_dir_problem(run_dir: Path) -> str | None:
    """Why the run directory cannot be created or written (None: it can). Nothing is created here."""
    path = Path(run_dir).absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"--run-dir {run_dir}: {existing} is not a directory, so the run directory cannot be made there"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        return f"--run-dir {run_dir} {what}: choose a --run-dir (or --run-id) under a writable directory"
    return None


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
