"""`k3 train`: parse the recipe's flags, resolve and validate them, check every input (``check_inputs`` and
:mod:`k3.launch.preflight`; ``--dry-run`` stops here and writes nothing), take the run directory's lock
(:mod:`k3.launch.run_lock`), write the resolved config into it, then hand the run to the training loop
(:func:`run_resolved`: ``k3.rl.loop.run`` with the run's typed settings and its Ray placement).

The command forwards its raw words to the argparse parser of :mod:`k3.launch.parser`, so ``k3 train --help``
is that parser's help (every flag, its default and its ``K3_*`` variable).
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import typer

from k3.launch import preflight
from k3.launch.args import LaunchConfigError, ResolvedConfig, TrainArgs, resolve
from k3.launch.failed_start import is_failed_start, set_aside_failed_start
from k3.launch.parser import parse_train_args
from k3.launch.resolved_config import (JSON_NAME, format_argument_dump, print_args_table, read_resolved_config,
                                      write_resolved_config)
from k3.launch.run_lock import RunDirectoryBusy, RunLock, refuse_if_held
from k3.rollout.registry import engine_kind

__all__ = ["train", "main", "run_resolved", "check_inputs", "RESUME_MUST_MATCH"]

# Resuming loads the saved adapters onto the same base: these cannot change between the runs.
RESUME_MUST_MATCH = ("model_variant", "hf_checkpoint", "lora_rank", "lora_alpha", "target_modules",
                     "experts_shared_outer_loras")
# A run directory holding any of these is a run: never overwritten without --resume.
RUN_MARKERS = (JSON_NAME, "metrics.jsonl", "adapters")


def train(ctx: typer.Context) -> None:
    """Run LoRA GRPO on Kimi-K3 with the public recipe's flags (see `k3 train --help`)."""
    raise typer.Exit(main(ctx.args))


# `k3.launch.cli` passes these to `app.command()`: the words after `k3 train` (--help included) reach argparse.
train.command_settings = {  # type: ignore[attr-defined]
    "context_settings": {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    "add_help_option": False,
}


def main(argv: Sequence[str]) -> int:
    """`k3 train ARGV`; returns the exit code (0 ok, 1 dry run found problems or the run failed or was refused,
    2 bad configuration). Nothing is written into the run directory before every check passed and its lock
    (``k3.launch.run_lock``) is held."""
    try:
        args = parse_train_args(argv)
        resolved, previous = _resolve_for_run_dir(args)
    except (LaunchConfigError, FileNotFoundError) as e:
        print(f"k3 train: error: {e}", file=sys.stderr)
        return 2
    try:
        refuse_if_held(resolved.run_dir)  # a running run's directory: say so first, whatever else is wrong
    except RunDirectoryBusy as e:
        print(f"k3 train: error: {e}", file=sys.stderr)
        return 1
    refusal = preflight.resume_refusal(resolved, previous)
    if refusal is not None:
        print(f"k3 train: error: {refusal}", file=sys.stderr)
        return 1
    print_args_table(resolved)

    checks = preflight.run_checks(resolved)
    problems = check_inputs(resolved) + checks.problems
    for note in checks.notes:
        print(f"note: {note}")
    if args.dry_run:
        if not args.resume:
            try:
                _refuse_a_held_run(resolved.run_dir, dry_run=True)
            except LaunchConfigError as e:
                problems.append(str(e))
        # What the run would write as resolved_config.txt (scripts grep its lines; nothing is written).
        print(format_argument_dump({k: v for k, v in resolved.to_dict().items() if k != "env"}), end="")
        for fact in checks.facts:  # what each checkpoint is and who loads it
            print(fact)
        for problem in problems:
            print(f"k3 train: {problem}", file=sys.stderr)
        print("dry run: " + ("configuration valid, inputs present" if not problems else
                             f"{len(problems)} problem(s) above") + "; not training; nothing written")
        return 1 if problems else 0
    if problems:
        for problem in problems:
            print(f"k3 train: error: {problem}", file=sys.stderr)
        return 2

    try:
        lock = RunLock.acquire(resolved.run_dir)  # before anything else is written; held for the run's life
    except RunDirectoryBusy as e:
        print(f"k3 train: error: {e}", file=sys.stderr)
        return 1
    try:
        return _run_locked(args, resolved, previous)
    finally:
        lock.release()


def _run_locked(args: TrainArgs, resolved: ResolvedConfig, previous: dict | None) -> int:
    try:
        if not args.resume:
            _refuse_a_held_run(resolved.run_dir)
        _save_previous_config(resolved, previous)
        json_path, text_path = write_resolved_config(resolved)
    except LaunchConfigError as e:
        print(f"k3 train: error: {e}", file=sys.stderr)
        return 2
    print(f"resolved config: {json_path} and {text_path}")
    try:
        loop = importlib.import_module("k3.rl.loop")
    except ModuleNotFoundError as e:
        if e.name not in ("k3.rl", "k3.rl.loop"):
            raise  # a dependency of the loop is missing: show the real error
        print(f"k3 train: error: training loop not available yet (k3.rl.loop is missing); the resolved config "
              f"is in {json_path.parent}", file=sys.stderr)
        return 2
    try:
        run_resolved(resolved)
    except loop.TrainingError as e:
        print(f"k3 train: error: {e}", file=sys.stderr)
        return 1
    return 0


def run_resolved(resolved: ResolvedConfig, *, in_process: bool | None = None, sabotage_sync: bool = False) -> int:
    """Run the training loop on ``resolved``: ``k3.rl.loop.run`` with the run's settings, its Ray placement
    (started by the loop when it runs under Ray) and its resolved config for W&B. ``in_process`` /
    ``sabotage_sync``: as ``k3.rl.loop.run``. Returns the loop's exit code; raises its ``TrainingError``."""
    from k3.launch.placement import RayPlacement

    loop = importlib.import_module("k3.rl.loop")
    return loop.run(resolved.settings, in_process=in_process, sabotage_sync=sabotage_sync,
                    start_placement=lambda: RayPlacement.start(resolved), wandb_config=resolved.to_dict())


def _refuse_a_held_run(run_dir: Path, dry_run: bool = False) -> None:
    """A fresh run needs a directory that holds no run; a failed start (``k3.launch.failed_start``) is set aside
    (a dry run only says it would be)."""
    held = [m for m in RUN_MARKERS if (run_dir / m).exists()]
    if not held:
        return
    if is_failed_start(run_dir):
        if not dry_run:
            kept = set_aside_failed_start(run_dir)
            print(f"note: {run_dir} held a start that failed before any work; its events are kept in {kept.name}")
        return
    raise LaunchConfigError(
        f"--run-dir {run_dir} already holds a run ({', '.join(held)}): pass --resume to continue it, or "
        "choose another --run-dir / --run-id"
    )


def _resolve_for_run_dir(args: TrainArgs) -> tuple[ResolvedConfig, dict | None]:
    """Resolve ``args`` against its run directory: a new run needs a fresh one, ``--resume`` an existing one.

    Returns the resolved config and, on resume, the config the run was started with.
    """
    if not args.resume:
        return resolve(args), None  # whether the directory is free is checked under its lock

    if args.run_dir is None and args.run_id is None:
        raise LaunchConfigError("--resume needs the run to continue: pass --run-dir DIR (or --run-id ID)")
    run_dir = Path(args.run_dir) if args.run_dir is not None else Path("runs") / args.run_id
    if not (run_dir / JSON_NAME).is_file():
        raise LaunchConfigError(f"--resume: {run_dir} has no {JSON_NAME}, so there is no run to continue; drop "
                                "--resume to start one there")
    previous = read_resolved_config(run_dir)
    if args.run_id is None:
        args = _with(args, run_id=previous.get("run_id"))
    resolved = resolve(_with(args, run_dir=str(run_dir)))
    now = resolved.to_dict()
    changed = [k for k in RESUME_MUST_MATCH if previous.get(k) != now.get(k)]
    if changed:
        detail = "; ".join(f"{k} was {previous.get(k)!r}, now {now.get(k)!r}" for k in changed)
        raise LaunchConfigError(f"--resume: the saved adapters do not fit the new flags ({detail}): resume with the "
                                "run's values, or start a new run")
    return resolved, previous


def _with(args: TrainArgs, **changes: object) -> TrainArgs:
    return dataclasses.replace(args, **changes)


def _save_previous_config(resolved: ResolvedConfig, previous: dict | None) -> None:
    """On resume with changed flags, keep the old config beside the new one and say what changed."""
    if previous is None:
        return
    now = resolved.to_dict()
    changed = sorted(k for k in set(previous) | set(now) if k != "env" and previous.get(k) != now.get(k))
    if not changed:
        return
    shutil.copyfile(resolved.run_dir / JSON_NAME, resolved.run_dir / "resolved_config.previous.json")
    for key in changed:
        print(f"resume: {key} {previous.get(key)!r} -> {now.get(key)!r}")


def check_inputs(resolved: ResolvedConfig) -> list[str]:
    """Problems with the files the run reads (checkpoint, data, engine sources), each saying what to do."""
    a, data = resolved.args, resolved.data
    problems: list[str] = []
    if a.hf_checkpoint is None:
        problems.append(f"--hf-checkpoint is required for --model-variant {a.model_variant}: make one with "
                        f"`k3 make-checkpoint --variant {a.model_variant} --format bf16 --out DIR` and pass "
                        "--hf-checkpoint DIR")
    elif not (Path(a.hf_checkpoint) / "config.json").is_file():
        what = "does not exist" if not Path(a.hf_checkpoint).exists() else "has no config.json"
        problems.append(f"--hf-checkpoint {a.hf_checkpoint} {what}: pass the directory of an HF checkpoint")
    # Without --ref-load the megatron backend loads the base from --hf-checkpoint; a given one must exist.
    if a.backend == "megatron" and a.ref_load is not None and not Path(a.ref_load).exists():
        problems.append(f"--ref-load {a.ref_load} does not exist: pass a torch_dist checkpoint made by "
                        "`k3 convert hf-to-dist --hf-checkpoint BF16 --save DCP`, or leave --ref-load out to load "
                        "the base from --hf-checkpoint")
    fetch = f"`k3 prepare-data --task {a.task} --data-dir {a.data_dir}`"
    if not Path(data.prompt_data).is_file():
        problems.append(f"training data {data.prompt_data} not found: run {fetch}")
    if data.eval_prompt_data is not None and not Path(data.eval_prompt_data).is_file():
        problems.append(f"eval data {data.eval_prompt_data} not found (needed by --eval-interval): run {fetch}")
    problems += engine_kind(a.rollout_engine).input_problems(resolved.rollout)
    return problems
