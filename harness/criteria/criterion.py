"""A criterion, as a tier spec states it, and its verdict on a run: :class:`Criterion`, :class:`Result`,
:class:`Status`, the :class:`Window` it looks at, and what every kind shares in judging (PENDING or MISSING
while the data is not there, numbers as the summaries print them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from harness.run_data import RunData


class SpecError(ValueError):
    """A tier spec is wrong; the message names the file, the criterion and the field."""


class Status(StrEnum):
    """A verdict: PASS, FAIL, PENDING (more data can still decide it), MISSING (the run is over without it)."""

    PASS = "PASS"
    FAIL = "FAIL"
    PENDING = "PENDING"
    MISSING = "MISSING"


@dataclass(frozen=True)
class Window:
    """Inclusive index range; ``last is None``: open-ended (to the end of the run)."""

    first: int = 0
    last: int | None = None

    @property
    def open(self) -> bool:
        return self.last is None

    def contains(self, index: int) -> bool:
        return index >= self.first and (self.last is None or index <= self.last)

    def required(self) -> list[int]:
        """The indices a closed window needs (an open one needs none in particular)."""
        return [] if self.last is None else list(range(self.first, self.last + 1))

    def __str__(self) -> str:
        if self.first == 0 and self.last is None:
            return "all"
        if self.last is None:
            return f"{self.first}–end"
        return str(self.first) if self.first == self.last else f"{self.first}–{self.last}"


@dataclass(frozen=True)
class Criterion:
    """One ``[[criterion]]`` table of a tier spec, checked (:func:`harness.criteria.build_criterion`)."""

    id: str
    kind: str
    metrics: tuple[str, ...]  # the first one the run has data for is used
    doc: str
    window: Window
    params: Mapping[str, Any]
    profile: str | None = None
    title: str = ""
    where: str = ""  # "full.toml: criterion 'aime_at_0'"

    @property
    def metric(self) -> str:
        return self.metrics[0]

    def __getitem__(self, name: str) -> Any:
        return self.params[name]


@dataclass
class Result:
    """One criterion's verdict on a run as it is now, with its one-line summary and its evidence."""

    criterion: Criterion
    status: Status
    summary: str  # one line for tables
    final: bool  # True: no later data can change this verdict
    evidence: dict[str, Any] = field(default_factory=dict)  # JSON-able: values, indices, first failure
    where: str | None = None  # file:line of the value that decided it, when one did

    @property
    def id(self) -> str:
        return self.criterion.id

    @property
    def hard_fail(self) -> bool:
        return self.status is Status.FAIL and self.final

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.criterion.kind, "status": str(self.status), "final": self.final,
                "summary": self.summary, "where": self.where, "evidence": self.evidence,
                "doc": self.criterion.doc}


def not_yet(c: Criterion, run: RunData, what: str, **evidence: Any) -> Result:
    """PENDING while the run goes on, MISSING once it is over."""
    if run.finished:
        return Result(c, Status.MISSING, f"{what} (run finished)", True, evidence)
    return Result(c, Status.PENDING, f"{what} (yet)", False, evidence)


def fmt(x: float, digits: int = 3) -> str:
    """``x`` as the summaries print it: at most ``digits`` decimals, no trailing zeros; NaN as ``NaN``."""
    if math.isnan(x):
        return "NaN"
    return f"{x:.{digits}f}".rstrip("0").rstrip(".") if abs(x) < 1e6 else f"{x:.3g}"


def passed(c: Criterion, run: RunData, text: str, evidence: dict[str, Any]) -> Result:
    """PASS on what the run has; PENDING (``text`` + " so far") while an open window's run goes on: later data can
    still fail it."""
    if c.window.open and not run.finished:
        return Result(c, Status.PENDING, text + " so far", False, evidence)
    return Result(c, Status.PASS, text, True, evidence)
