"""Delivered == trained: what the engines report they activated at a sync, against what the trainer sent.

The trainer digests every chunk it exports (``TrainerWorker.update_weights``: ``chunk_digests``, in chunk order);
each engine digests every chunk it activated (``adapter_report``: ``{"version", "chunk_digests": {index: digest}}``,
over the tensors as its model holds them). A sync delivered its version only when every engine reports that
version as active and, for every chunk the trainer sent, a digest equal to the trainer's (verl-project/verl#7495,
vllm-project/vllm#41754: adapters silently not delivered or not applied). The sync event carries both sides
(docs/RUN_DIRECTORY.md), so the harness's ``delivered`` criterion judges the same from the run directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["delivery_keys", "delivery_problems", "served_version"]


def served_version(reports: Sequence[dict[str, Any]], version: int) -> int:
    """The version the engines report active: ``version`` when all do, else the first engine's that does not."""
    return next((int(r["version"]) for r in reports if int(r["version"]) != version), version)


def delivery_keys(trained: Sequence[str], reports: Sequence[dict[str, Any]], version: int) -> dict[str, Any]:
    """The sync event's delivery fields: ``adapter/engine_version`` (from the engines' answers), ``chunk_digests``
    (the trainer's, in order) and ``engine_chunk_digests`` (per engine: its reported version and
    ``{"<chunk index>": digest}``)."""
    return {"adapter/engine_version": served_version(reports, version),
            "chunk_digests": list(trained),
            "engine_chunk_digests": [{"engine": k, "version": int(r["version"]),
                                      "chunks": {str(i): d for i, d in sorted(r["chunk_digests"].items())}}
                                     for k, r in enumerate(reports)]}


def delivery_problems(trained: Sequence[str], reports: Sequence[dict[str, Any]], version: int) -> list[str]:
    """What the engines did not activate of ``version``: one line per engine and chunk (empty: delivered)."""
    problems = []
    for k, report in enumerate(reports):
        which = "the engine" if len(reports) == 1 else f"engine {k}"
        active = int(report["version"])
        if active != version:
            problems.append(f"{which} reports version {active} active, expected {version}")
            continue
        got = {int(i): d for i, d in report["chunk_digests"].items()}
        for index, digest in enumerate(trained):
            if index not in got:
                problems.append(f"chunk {index} of version {version} is missing at {which}")
            elif got[index] != digest:
                problems.append(f"chunk {index} of version {version} differs at {which}: digest {got[index][:12]}… "
                                f"activated, {digest[:12]}… trained")
        extra = sorted(set(got) - set(range(len(trained))))
        if extra:
            problems.append(f"{which} reports chunks {extra} of version {version}, which the trainer never sent")
    return problems
