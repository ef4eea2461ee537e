"""The parameters a kind of criterion takes: their types, defaults and choices, checked as a spec is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.criteria.criterion import Criterion, SpecError


@dataclass(frozen=True)
class Param:
    """One parameter of a kind: its accepted types, whether it is required, its default and its choices."""

    types: tuple[type, ...]
    required: bool = False
    default: Any = None
    choices: tuple[Any, ...] = ()


NUMBER = (int, float)
COMMON = {"id", "kind", "metric", "doc", "window", "profile", "title"}


def param_value(where: str, name: str, spec: Param, raw: Any) -> Any:
    """``raw`` checked against ``spec`` (numbers as floats); :class:`SpecError` naming ``where`` and ``name``."""
    if isinstance(raw, bool) and bool not in spec.types:
        raise SpecError(f"{where}: {name!r} must be {_type_names(spec.types)}, got {raw!r}")
    if not isinstance(raw, spec.types):
        raise SpecError(f"{where}: {name!r} must be {_type_names(spec.types)}, got {raw!r}")
    if spec.choices and raw not in spec.choices:
        raise SpecError(f"{where}: {name!r} must be one of {', '.join(map(repr, spec.choices))}, got {raw!r}")
    return float(raw) if spec.types == NUMBER else raw


def _type_names(types: tuple[type, ...]) -> str:
    names = ["a number" if t in NUMBER else f"a {t.__name__}" for t in types]
    return " or ".join(dict.fromkeys(names))


def decimals(x: float) -> int:
    """How many decimals ``x`` is written with (6 when in exponent form): the precision a page printed it at."""
    text = repr(float(x))
    return len(text.split(".")[1]) if "." in text and "e" not in text else 6


def check_positive(*names: str) -> Callable[[Criterion], None]:
    """A spec check that the named parameters, where given, are not negative."""
    def check(c: Criterion) -> None:
        for name in names:
            if c[name] is not None and c[name] < 0:
                raise SpecError(f"{c.where}: {name!r} must not be negative, got {c[name]}")
    return check
