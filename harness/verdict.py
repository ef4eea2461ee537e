"""The verdict of a set of results, and the exit codes every entry point shares."""

from __future__ import annotations

from collections.abc import Sequence

from harness.criteria import Result, Status

__all__ = ["overall", "exit_code", "EXIT_PASS", "EXIT_FAIL", "EXIT_INCOMPLETE", "EXIT_INPUT", "EXIT_CODES"]

EXIT_PASS = 0  # every criterion passed
EXIT_FAIL = 1  # at least one criterion failed
EXIT_INCOMPLETE = 3  # nothing failed, but something is PENDING or MISSING (MISSING never passes)
EXIT_INPUT = 4  # the spec or the run could not be read

EXIT_CODES = {
    EXIT_PASS: "every criterion PASS",
    EXIT_FAIL: "at least one criterion FAIL",
    EXIT_INCOMPLETE: "no FAIL, but some criterion PENDING or MISSING",
    EXIT_INPUT: "the spec or the run could not be read",
}


def overall(results: Sequence[Result]) -> Status:
    """FAIL if any failed, else MISSING if any is missing, else PENDING if any is pending, else PASS."""
    statuses = {r.status for r in results}
    if not results:
        return Status.MISSING
    for status in (Status.FAIL, Status.MISSING, Status.PENDING):
        if status in statuses:
            return status
    return Status.PASS


def exit_code(results: Sequence[Result]) -> int:
    verdict = overall(results)
    if verdict is Status.PASS:
        return EXIT_PASS
    if verdict is Status.FAIL:
        return EXIT_FAIL
    return EXIT_INCOMPLETE
