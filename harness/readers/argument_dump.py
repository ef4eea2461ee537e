"""Megatron's argument dump: ``  expert_model_parallel_size ...................... 8``.

Megatron prints every resolved argument once at startup between ``---- arguments ----`` and
``---- end of arguments ----``; ``k3 train`` writes the same layout to ``resolved_config.txt``. In a stdout
log the line may carry a prefix (Ray's ``(MegatronTrainRayActor pid=…)``, a logger timestamp), so the name is
found as the last word before the dots.
"""

from __future__ import annotations

import re

__all__ = ["DUMP_LINE", "parse_dump_line"]

# <word> <three or more dots> <value>; the value is the rest of the line (it may contain spaces: "[1, 2]").
DUMP_LINE = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*) \.{3,} (.*?)\s*$")


def parse_dump_line(text: str) -> tuple[str, str] | None:
    """``(name, value)`` of one dump line, or None when the line is not one."""
    m = DUMP_LINE.search(text)
    if m is None:
        return None
    return m.group(1), m.group(2)
