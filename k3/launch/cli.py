"""`k3` (and `python -m k3`, `torchrun ... -m k3`): the command line of k3-lora-rl.

Every sub-command lives in `k3/launch/` (the command line only; the work is done by the part it drives) and is
registered here by name. The commands keep their heavy imports inside the command, so `k3 --help` stays fast, and a
command module that fails to import (a missing optional dependency) only makes its own command unavailable.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="k3",
    help="LoRA RL for Kimi-K3: synthetic checkpoints, converters, data, GRPO training on the embedded engine "
    "or SGLang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# (command name, "module:function") — each function is a typer command (annotated parameters).
COMMANDS: list[tuple[str, str]] = [
    ("make-checkpoint", "k3.launch.checkpoint_commands:make_checkpoint"),
    ("prepare-data", "k3.launch.prepare_data:prepare_data"),
    ("train", "k3.launch.train:train"),
    ("record-fla-tuning", "k3.launch.record_fla_tuning:record_fla_tuning"),
]
# (group name, "module:typer app")
GROUPS: list[tuple[str, str]] = [
    ("convert", "k3.launch.checkpoint_commands:convert_app"),
]


def _resolve(target: str):
    mod, attr = target.split(":")
    return getattr(importlib.import_module(mod), attr)


def _register() -> None:
    for name, target in COMMANDS:
        try:
            fn = _resolve(target)
            # A command may carry its own `app.command()` settings (`k3 train` hands its raw words to argparse).
            app.command(name, **getattr(fn, "command_settings", {}))(fn)
        except (ImportError, AttributeError) as e:  # a part not built yet must not break the others
            _missing(name, target, e)
    for name, target in GROUPS:
        try:
            app.add_typer(_resolve(target), name=name)
        except (ImportError, AttributeError) as e:
            _missing(name, target, e)


def _missing(name: str, target: str, err: Exception) -> None:
    @app.command(name, help=f"(unavailable: {err})")
    def _unavailable() -> None:
        typer.echo(f"k3 {name}: unavailable ({target}: {err})", err=True)
        raise typer.Exit(2)


def main() -> None:
    """The ``k3`` script's entry point and ``python -m k3``'s (``k3/__main__.py``)."""
    _register()
    app()


if __name__ == "__main__":  # `python -m k3.launch.cli` would otherwise import the app and exit 0 having done nothing
    main()
