"""The `k3 train` command line: an argparse parser generated from :class:`~k3.launch.args.TrainArgs`.

Each field becomes ``--kebab-name`` (bools as ``--x/--no-x``, lists as several values); its default may be set
by the environment variable ``K3_<FIELD_UPPER>`` (so ``K3_HF_CHECKPOINT=/ckpt`` = ``--hf-checkpoint /ckpt``), and
a flag on the command line wins over the environment. ``--help`` lists every flag with its one-line
explanation, default and variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from k3.launch.args import ENV_PREFIX, LaunchConfigError, TrainArgs
from k3.launch.refused_flags import REFUSED_FLAGS, refusal

__all__ = ["build_parser", "parse_train_args", "env_var_name", "flag_name"]

GROUP_TITLES = {
    "run": "run",
    "model": "model and backend",
    "cluster": "cluster",
    "parallelism": "training parallelism (derived per variant; see the recipe's layout rules)",
    "rollout": "rollout",
    "data": "data, reward and eval",
    "lora": "LoRA",
    "training": "training",
    "sync": "adapter sync and memory",
    "logging": "logging",
    "refused": "refused: flags of the recipe's launcher that k3 cannot honour (each says why)",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_var_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _field_kind(name: str, annotation: Any) -> tuple[str, Callable[[str], Any], bool]:
    """(kind, scalar converter, optional) for a field: kind is bool, list or scalar."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args and optional else annotation
    if base is bool:
        return "bool", _parse_bool, optional
    if typing.get_origin(base) is list:
        return "list", str, optional
    if base is float:
        return "scalar", _parse_finite_float, optional
    return "scalar", base, optional


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")


def _parse_finite_float(text: str) -> float:
    """A float flag's value; NaN and infinities are refused here (a NaN learning rate trains nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _from_env(name: str, text: str, kind: str, convert: Callable[[str], Any], optional: bool) -> Any:
    var = env_var_name(name)
    if optional and text.strip().lower() in {"", "none"}:
        return None
    try:
        if kind == "list":
            return [w for w in text.replace(",", " ").split() if w]
        return convert(text)
    except (ValueError, argparse.ArgumentTypeError) as e:
        what = _KIND_WORDS.get(convert, getattr(convert, "__name__", "value"))
        raise LaunchConfigError(f"{var}={text!r}: not {what} for {flag_name(name)} ({e})") from None


_KIND_WORDS = {int: "an integer", float: "a number", _parse_finite_float: "a finite number", str: "a string",
               _parse_bool: "a boolean"}


def _shown(value: Any) -> str:
    if value == "":
        return '""'
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


class _Refuse(argparse.Action):
    """A flag k3 cannot honour (:data:`~k3.launch.refused_flags.REFUSED_FLAGS`): stop at once with its reason."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(refusal(self.dest))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=120)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The `k3 train` parser; defaults come from :class:`TrainArgs` overridden by ``K3_*`` in ``environ``."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="k3 train",
        description="LoRA GRPO on Kimi-K3 with the public recipe's flags (same names and defaults). The trainer "
        "and the rollout engine run as Ray actors colocated on the same devices; the resolved configuration is "
        "written to <run-dir>/resolved_config.{json,txt} before training starts.",
        epilog="Every flag can also be set through its environment variable; the command line wins.\n\n"
        "validated full launch (16 nodes x 4 GPUs, resolves to TP4 x CP2 x PP8, EP8):\n"
        "  k3 train --mode normal --model-variant full --task dapo-math --reward-model deepscaler \\\n"
        "    --num-nodes 16 --num-gpus-per-node 4 --pipeline-parallel-size 8 --context-parallel-size 2 \\\n"
        "    --rollout-tp-size 16 --rollout-max-concurrency 8 --lora-rank 32 --lora-alpha 64 ...",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    hints = typing.get_type_hints(TrainArgs)
    defaults = TrainArgs()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainArgs):
        meta = f.metadata
        group_name = meta.get("group", "run")
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(GROUP_TITLES.get(group_name, group_name))
        group = groups[group_name]
        kind, convert, optional = _field_kind(f.name, hints[f.name])
        default = getattr(defaults, f.name)
        var = env_var_name(f.name)
        if var in environ:
            default = _from_env(f.name, environ[var], kind, convert, optional)
        suffix = f"env {var}" if default is None else f"default: {_shown(default)}; env {var}"
        help_text = f"{meta.get('help', '')} [{suffix}]".replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if kind == "bool":
            group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if kind == "list":
            kwargs.update(nargs="+", metavar=f.name.upper().split("_")[-1])
        else:
            kwargs.update(type=convert, metavar=meta.get("metavar") or _metavar(convert))
        if meta.get("choices"):  # for a list, each value is checked
            kwargs.update(choices=meta["choices"], metavar="{" + ",".join(meta["choices"]) + "}")
        group.add_argument(flag_name(f.name), **kwargs)
    refused = parser.add_argument_group(GROUP_TITLES["refused"])
    for name, why in REFUSED_FLAGS.items():
        if env_var_name(name) in environ:
            raise LaunchConfigError(f"{env_var_name(name)} is set, but {refusal(name)}; unset it")
        refused.add_argument(flag_name(name), dest=name, nargs="*", metavar="VALUE", action=_Refuse,
                             default=argparse.SUPPRESS,
                             help=f"not supported: {why}".replace("%", "%%"))
    return parser


def _metavar(convert: Callable[[str], Any]) -> str:
    return {int: "N", _parse_finite_float: "X"}.get(convert, "STR")


def parse_train_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> TrainArgs:
    """``argv`` (the words after ``k3 train``) → :class:`TrainArgs`. ``--help`` and bad flags exit as argparse
    does (code 0 / 2); a malformed ``K3_*`` variable raises :class:`LaunchConfigError`."""
    namespace = build_parser(environ).parse_args(list(argv))
    return TrainArgs(**vars(namespace))
