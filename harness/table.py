"""Terminal output of ``k3-harness check`` / ``watch`` / ``criteria``: the results (or a tier's criteria) as a
rich table when the terminal is wide, one block per criterion when it is not (a narrow table would squeeze the
observed values and the recipe sentences, the point of the output, to a few characters), then the notes on a
resumed run and the reader's problems."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.criteria import Criterion, Result, Status
from harness.run_data import RunData
from harness.verdict import overall

__all__ = ["STATUS_STYLE", "WIDE_RESULTS", "WIDE_CRITERIA", "results_table", "print_results", "print_problems",
           "print_notes", "print_result_blocks", "print_criteria_blocks", "numbers_text"]

STATUS_STYLE = {Status.PASS: "bold green", Status.FAIL: "bold red", Status.PENDING: "yellow",
                Status.MISSING: "bold magenta"}
MAX_PROBLEMS_SHOWN = 20
# Narrower terminals get blocks: the results table needs its status, id (up to 34 characters) and where
# columns beside a readable "Observed"; the criteria table six columns beside the sentence.
WIDE_RESULTS = 120
WIDE_CRITERIA = 140
INDENT = 4


def results_table(results: Sequence[Result], title: str) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, show_lines=False, expand=False)
    table.add_column("Status", no_wrap=True)
    table.add_column("Criterion", style="cyan", no_wrap=True)
    table.add_column("Observed", overflow="fold")
    table.add_column("Where", style="dim", overflow="fold")
    for r in results:
        table.add_row(_status_text(r), r.id, Text(r.summary), Text(r.where or ""))
    return table


def _status_text(r: Result) -> Any:
    from rich.text import Text

    status = Text(str(r.status), style=STATUS_STYLE[r.status])
    if r.status is Status.FAIL and not r.final:
        status.append(" (may recover)", style="dim")
    return status


def print_result_blocks(console: Any, results: Sequence[Result], title: str) -> None:
    """One block per result: status and id on a line, then what was observed and where, wrapped and indented."""
    from rich.padding import Padding
    from rich.text import Text

    console.print(Text(title, style="bold"))
    for r in results:
        console.print(_status_text(r) + Text("  ") + Text(r.id, style="cyan"))
        body = Text(r.summary)
        if r.where:
            body.append(f"\nat {r.where}", style="dim")
        console.print(Padding(body, (0, 0, 0, INDENT), expand=False))


def numbers_text(c: Criterion, sep: str) -> str:
    """A criterion's numbers as ``name = value`` pairs (those that are set)."""
    return sep.join(f"{k} = {v}" for k, v in c.params.items() if v is not None)


def print_criteria_blocks(console: Any, criteria: Sequence[Criterion], title: str) -> None:
    """``k3-harness criteria`` for a narrow terminal: per criterion its id, kind and window, then the metric,
    the numbers and the whole sentence it encodes, wrapped."""
    from rich.padding import Padding
    from rich.text import Text

    console.print(Text(title, style="bold"))
    for c in criteria:
        head = Text(c.id, style="cyan") + Text(f"  {c.kind}, window {c.window}")
        if c.profile:
            head.append(f"  [profile {c.profile}]", style="dim")
        console.print(Text(""))
        console.print(head)
        body = Text("metric: ", style="dim") + Text(" | ".join(c.metrics))
        numbers = numbers_text(c, ", ")
        if numbers:
            body += Text("\nnumbers: ", style="dim") + Text(numbers)
        body += Text("\n") + Text(c.doc)
        console.print(Padding(body, (0, 0, 0, INDENT), expand=False))


def print_problems(console: Any, run: RunData) -> None:
    from rich.text import Text

    if not run.problems:
        return
    console.print(Text(f"{len(run.problems)} line(s) could not be used (skipped):", style="bold yellow"))
    for p in run.problems[:MAX_PROBLEMS_SHOWN]:
        console.print(Text(f"  {p}"))
    if len(run.problems) > MAX_PROBLEMS_SHOWN:
        console.print(Text(f"  … and {len(run.problems) - MAX_PROBLEMS_SHOWN} more (the report lists all)"))


def print_notes(console: Any, run: RunData) -> None:
    """How the run's attempts were read (a resumed run): which rollouts a later attempt superseded."""
    from rich.text import Text

    for note in run.notes():
        console.print(Text("note: ", style="bold cyan") + Text(note))


def print_results(console: Any, results: Sequence[Result], run: RunData, title: str) -> None:
    """Table (or blocks on a narrow terminal), notes, problems, then the one-line verdict."""
    from rich.text import Text

    if console.width < WIDE_RESULTS:
        print_result_blocks(console, results, title)
    else:
        console.print(results_table(results, title))
    print_notes(console, run)
    print_problems(console, run)
    verdict = overall(results)
    counts = {s: sum(r.status is s for r in results) for s in Status}
    line = Text("verdict: ", style="bold") + Text(str(verdict), style=STATUS_STYLE[verdict])
    line += Text("  (" + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f"; {run.events} events read)")
    console.print(line)
