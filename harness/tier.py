"""Tiers: the criteria of one kind of run, read from ``harness/spec/<tier>.toml``.

A spec file has a ``[tier]`` table (``name``, ``title``, ``doc``, ``source``), optional ``[profiles.<name>]``
tables (hardware profiles: criteria marked ``profile = "<name>"`` apply only when that profile is chosen), an
optional ``[watch]`` table (``stall_multiple``, ``startup_allowance_minutes``: when ``watch`` fails a silent
run, :mod:`harness.stall`; absent: 3 × the median cycle and 60 minutes), and one ``[[criterion]]`` table per
criterion (fields: :mod:`harness.criteria`). Every error names the file and the criterion.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from harness.criteria import Criterion, SpecError, build_criterion
from harness.stall import DEFAULT_STALL_RULE, StallRule

__all__ = ["Tier", "load_tier", "builtin_tiers", "SpecError"]


@dataclass(frozen=True)
class Tier:
    name: str
    title: str
    doc: str
    source: str  # where its numbers come from
    path: str
    criteria: tuple[Criterion, ...]
    profiles: dict[str, str] = field(default_factory=dict)  # profile name -> what it is
    stall: StallRule = DEFAULT_STALL_RULE  # when watch fails a run that writes nothing

    def active(self, profile: str | None = None) -> list[Criterion]:
        """The criteria that apply: the general ones plus those of ``profile``."""
        if profile is not None and profile not in self.profiles:
            raise SpecError(f"{self.path}: no hardware profile {profile!r} (profiles: "
                            f"{', '.join(sorted(self.profiles)) or 'none'})")
        return [c for c in self.criteria if c.profile is None or c.profile == profile]


def builtin_tiers() -> list[str]:
    """Names of the tiers shipped in ``harness/spec``."""
    spec_dir = resources.files("harness") / "spec"
    return sorted(p.name[:-5] for p in spec_dir.iterdir() if p.name.endswith(".toml"))


def load_tier(name_or_path: str | Path) -> Tier:
    """A built-in tier by name (``smoke``, ``gpu``, ``4layer``, ``full``) or a spec file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise SpecError(f"{path}: no such spec file")
        text, shown = path.read_text(encoding="utf-8"), str(path)
    else:
        spec = resources.files("harness") / "spec" / f"{name_or_path}.toml"
        if not spec.is_file():
            raise SpecError(f"unknown tier {str(name_or_path)!r} (built in: {', '.join(builtin_tiers())}; or give "
                            "a path to a .toml spec)")
        text, shown = spec.read_text(encoding="utf-8"), f"{name_or_path}.toml"
    return parse_tier(text, shown)


def parse_tier(text: str, where: str) -> Tier:
    """A :class:`Tier` from the text of a spec file (``where`` names it in errors)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{where}: not valid TOML: {e}") from None
    unknown = set(data) - {"tier", "profiles", "watch", "criterion"}
    if unknown:
        raise SpecError(f"{where}: unknown table(s) {', '.join(sorted(unknown))} (expected [tier], [profiles.*], "
                        "[watch], [[criterion]])")
    head = data.get("tier")
    if not isinstance(head, dict) or not isinstance(head.get("name"), str):
        raise SpecError(f"{where}: a [tier] table with a 'name' is required")
    profiles_raw = data.get("profiles", {})
    if not isinstance(profiles_raw, dict) or not all(isinstance(v, dict) for v in profiles_raw.values()):
        raise SpecError(f"{where}: [profiles.<name>] must be tables")
    profiles = {name: str(table.get("doc", "")) for name, table in profiles_raw.items()}
    tables = data.get("criterion")
    if not isinstance(tables, list) or not tables:
        raise SpecError(f"{where}: no [[criterion]] tables")
    criteria = [build_criterion(table, where, set(profiles)) for table in tables]
    seen: set[str] = set()
    for c in criteria:
        if c.id in seen:
            raise SpecError(f"{where}: criterion id {c.id!r} appears twice")
        seen.add(c.id)
    return Tier(name=head["name"], title=str(head.get("title", head["name"])), doc=str(head.get("doc", "")),
                source=str(head.get("source", "")), path=where, criteria=tuple(criteria), profiles=profiles,
                stall=_stall_rule(data.get("watch", {}), where))


def _stall_rule(table: object, where: str) -> StallRule:
    """The ``[watch]`` table: ``stall_multiple`` (≥ 1, or 0: off) and ``startup_allowance_minutes`` (> 0)."""
    if not isinstance(table, dict):
        raise SpecError(f"{where}: [watch] must be a table")
    unknown = set(table) - {"stall_multiple", "startup_allowance_minutes"}
    if unknown:
        raise SpecError(f"{where}: [watch]: unknown field(s) {', '.join(sorted(unknown))} (its fields: "
                        "stall_multiple, startup_allowance_minutes)")
    multiple = table.get("stall_multiple", DEFAULT_STALL_RULE.multiple)
    minutes = table.get("startup_allowance_minutes", DEFAULT_STALL_RULE.startup_allowance_s / 60)
    for name, value in (("stall_multiple", multiple), ("startup_allowance_minutes", minutes)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{where}: [watch]: {name!r} must be a number, got {value!r}")
    if multiple != 0 and multiple < 1:
        raise SpecError(f"{where}: [watch]: 'stall_multiple' must be ≥ 1 (or 0: no stall detection), got {multiple}")
    if minutes <= 0:
        raise SpecError(f"{where}: [watch]: 'startup_allowance_minutes' must be positive, got {minutes}")
    return StallRule(float(multiple), 60.0 * float(minutes))
