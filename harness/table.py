"""The results as a rich table (``k3-harness check`` / ``watch``), and the reader's problems under it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.criteria import Result, Status
from harness.run_data import RunData
from harness.verdict import overall

__all__ = ["STATUS_STYLE", "results_table", "print_results", "print_problems"]

STATUS_STYLE = {Status.PASS: "bold green", Status.FAIL: "bold red", Status.PENDING: "yellow",
                Status.MISSING: "bold magenta"}
MAX_PROBLEMS_SHOWN = 20


def results_table(results: Sequence[Result], title: str) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, show_lines=False, expand=False)
    table.add_column("Status", no_wrap=True)
    table.add_column("Criterion", style="cyan", no_wrap=True)
    table.add_column("Observed", overflow="fold")
    table.add_column("Where", style="dim", overflow="fold")
    for r in results:
        status = Text(str(r.status), style=STATUS_STYLE[r.status])
        if r.status is Status.FAIL and not r.final:
            status.append(" (may recover)", style="dim")
        table.add_row(status, r.id, Text(r.summary), Text(r.where or ""))
    return table


def print_problems(console: Any, run: RunData) -> None:
    from rich.text import Text

    if not run.problems:
        return
    console.print(Text(f"{len(run.problems)} line(s) could not be used (skipped):", style="bold yellow"))
    for p in run.problems[:MAX_PROBLEMS_SHOWN]:
        console.print(Text(f"  {p}"))
    if len(run.problems) > MAX_PROBLEMS_SHOWN:
        console.print(Text(f"  … and {len(run.problems) - MAX_PROBLEMS_SHOWN} more (the report lists all)"))


def print_results(console: Any, results: Sequence[Result], run: RunData, title: str) -> None:
    """Table, problems, then the one-line verdict."""
    from rich.text import Text

    console.print(results_table(results, title))
    print_problems(console, run)
    verdict = overall(results)
    counts = {s: sum(r.status is s for r in results) for s in Status}
    line = Text("verdict: ", style="bold") + Text(str(verdict), style=STATUS_STYLE[verdict])
    line += Text("  (" + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f"; {run.events} events read)")
    console.print(line)
