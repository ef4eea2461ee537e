"""`k3-harness`: judge a Kimi-K3 LoRA RL run against the recipe's health criteria.

RUN is a `k3 train` run directory (metrics.jsonl, resolved_config.*), the public recipe's stdout log, a
TensorBoard log directory or a W&B offline run. Exit codes: 0 every criterion PASS, 1 a FAIL, 3 no FAIL but
something PENDING or MISSING (MISSING never passes), 4 the spec or the run could not be read.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from harness.stall import StallRule
from harness.verdict import EXIT_CODES, EXIT_INPUT

app = typer.Typer(
    name="k3-harness",
    help=__doc__,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

RunArg = Annotated[Path, typer.Argument(help="run directory, recipe stdout log, TensorBoard dir or W&B offline run")]
TierOpt = Annotated[Optional[str], typer.Option(
    "--tier", "-t",
    help="smoke | gpu | 4layer | full, or a spec .toml (default: from the run's model_variant, else full)")]
ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", help="hardware profile whose extra criteria apply (full: gb300)")]
SummaryOpt = Annotated[Optional[Path], typer.Option(
    "--summary", help="also write a Markdown summary here (e.g. $GITHUB_STEP_SUMMARY)")]

VARIANT_TIERS = {"tiny": "smoke", "4layer": "4layer", "full": "full"}


def _console():
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console = Console(highlight=False, width=160)  # CI logs: no terminal width to fit, keep tables wide
    return console


def _fail_input(message: str) -> None:
    typer.echo(f"k3-harness: error: {message}", err=True)
    raise typer.Exit(EXIT_INPUT)


def _choose_tier(tier: str | None, run) -> tuple[object, str]:
    """The tier to judge by: the one asked for, else the run's variant's, else full."""
    from harness.tier import SpecError, load_tier

    if tier is None:
        variant = run.config.get("model_variant")
        if variant is None and run.config_problem is not None:
            _fail_input(f"{run.config_problem}: the tier cannot be told from the run's model_variant; pass --tier")
        if variant is not None and variant.value not in VARIANT_TIERS:
            _fail_input(f"model_variant {variant.value!r} ({variant.where}) has no tier (known: "
                        f"{', '.join(f'{v} → {t}' for v, t in VARIANT_TIERS.items())}); pass --tier")
        tier = VARIANT_TIERS[variant.value] if variant is not None else "full"
    try:
        return load_tier(tier), tier
    except SpecError as e:
        _fail_input(str(e))
        raise  # unreachable


def _criteria(tier_obj, profile: str | None):
    from harness.tier import SpecError

    try:
        return tier_obj.active(profile)
    except SpecError as e:
        _fail_input(str(e))
        raise


def _read(run_path: Path, finished: bool | None):
    """The run at ``run_path``; exit 4 when it cannot be read or nothing in it is recognised."""
    from harness.readers import ReaderError, expected_input, read_run

    try:
        data = read_run(run_path, finished=finished)
    except ReaderError as e:
        _fail_input(str(e))
        raise
    if data.events == 0:
        skipped = f" ({len(data.problems)} line(s) could not be used)" if data.problems else ""
        _fail_input(f"{run_path}: nothing recognised in it{skipped}; expected {expected_input(data.kind)}")
    return data


@app.command()
def check(
    run: RunArg,
    tier: TierOpt = None,
    profile: ProfileOpt = None,
    finished: Annotated[Optional[bool], typer.Option(
        "--finished/--running",
        help="treat the run as over (absent data is MISSING) or still going (PENDING); default: a run "
        "directory's status events say, logs count as finished")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the results as JSON here")] = None,
    summary: SummaryOpt = None,
) -> None:
    """Judge RUN as it is now; exit 0 only if every criterion passes."""
    from harness.criteria import evaluate_all
    from harness.report import markdown_summary
    from harness.table import print_results
    from harness.verdict import exit_code

    data = _read(run, finished)
    tier_obj, tier_name = _choose_tier(tier, data)
    results = evaluate_all(_criteria(tier_obj, profile), data)
    state = "finished" if data.finished else "running"
    print_results(_console(), results, data, f"{tier_obj.title} — {run} ({data.kind}, {state})")
    if json_out is not None:
        json_out.write_text(json.dumps({"run": str(run), "tier": tier_name, "profile": profile,
                                        "finished": data.finished, "results": [r.to_dict() for r in results],
                                        "notes": data.notes(), "problems": [str(p) for p in data.problems]},
                                       indent=2, default=str))
    if summary is not None:
        _append(summary, markdown_summary(results, data, tier_obj, profile))
    raise typer.Exit(exit_code(results))


@app.command()
def watch(
    run: RunArg,
    tier: Annotated[str, typer.Option("--tier", "-t", help="smoke | gpu | 4layer | full, or a spec .toml")] = "full",
    profile: ProfileOpt = None,
    kill_cmd: Annotated[Optional[str], typer.Option(
        "--kill-cmd", help="run on the first hard FAIL, e.g. \"ray job stop raysubmit_123\" (split like a "
        "shell, run without one)")] = None,
    poll: Annotated[float, typer.Option("--poll", help="seconds between reads of the run")] = 5.0,
    timeout: Annotated[Optional[float], typer.Option(
        "--timeout", help="give up after this many seconds (exit 3 unless something failed)")] = None,
    stall_multiple: Annotated[Optional[float], typer.Option(
        "--stall-multiple", help="fail the run when it writes no event for this many median cycles (default: "
        "the tier's [watch] stall_multiple; 0: never)")] = None,
    startup_allowance: Annotated[Optional[float], typer.Option(
        "--startup-allowance", help="minutes of silence allowed before the first cycle closes, and after a "
        "resume (default: the tier's [watch] startup_allowance_minutes)")] = None,
    summary: SummaryOpt = None,
) -> None:
    """Follow a live RUN, re-judge it on every new event, stop (and run --kill-cmd) on the first hard FAIL, or
    when the run writes nothing for --stall-multiple median cycles (by the clock).

    PENDING until the data arrives; ends when the run's status says finished (or failed), with the verdict
    as exit code.
    """
    from rich.text import Text

    from harness.monitor import Watcher, status_changes
    from harness.readers import ReaderError
    from harness.report import markdown_summary
    from harness.table import STATUS_STYLE, print_results
    from harness.tier import SpecError, load_tier

    console = _console()
    try:
        tier_obj = load_tier(tier)
        criteria = tier_obj.active(profile)
    except SpecError as e:
        _fail_input(str(e))
        raise
    stall = _stall_rule(tier_obj.stall, stall_multiple, startup_allowance)
    previous: list = []

    def on_update(results, data) -> None:
        stamp = time.strftime("%H:%M:%S")
        where = data.where_of(data.events - 1) if data.events else "-"
        for result, before in status_changes(previous, results):
            line = Text(f"[{stamp}] {where}: {result.id} ")
            line += Text(f"{before or 'start'} → ", style="dim") + Text(str(result.status),
                                                                          style=STATUS_STYLE[result.status])
            line += Text(f"  {result.summary}")
            console.print(line)
        previous[:] = results

    try:
        watcher = Watcher(run, criteria, kill_cmd=kill_cmd, poll_s=poll, timeout_s=timeout, on_update=on_update,
                          on_wait=lambda message: console.print(Text(message, style="dim")), stall=stall)
        outcome = watcher.run()
    except (ReaderError, ValueError) as e:
        _fail_input(str(e))
        raise
    if outcome.failed_at is not None:
        console.print(Text(f"\nFIRST HARD FAIL at {outcome.failed_where} (event {outcome.failed_at}):",
                           style="bold red"))
        for r in outcome.failures:
            console.print(Text(f"  {r.id}: {r.summary}" + (f"  [{r.where}]" if r.where else "")))
            console.print(Text(f"    {r.criterion.doc}", style="dim"))
    if outcome.quiet_end:
        console.print(Text(f"\nENDED OR STUCK (the log does not say which; judged as it stands): {outcome.stall}",
                           style="bold yellow"))
    elif outcome.stall is not None:
        console.print(Text(f"\nSTALLED: {outcome.stall}", style="bold red"))
    if outcome.kill is not None:
        k = outcome.kill
        style = "bold" if k.returncode == 0 else "bold red"
        # soft_wrap: a long command line (a path) stays one line that can be searched and copied
        console.print(Text(f"kill command {' '.join(k.command)!r}: exit {k.returncode}", style=style), soft_wrap=True)
        if k.output:
            console.print(Text(k.output, style="dim"))
    if outcome.timed_out:
        console.print(Text(f"timed out after {timeout} s", style="yellow"))
    state = (f"as of {outcome.failed_where}" if outcome.failed_at is not None else
             "stalled" if outcome.stall is not None else "watch")
    print_results(console, outcome.results, outcome.run, f"{tier_obj.title} — {run} ({state})")
    if summary is not None:
        text = markdown_summary(outcome.results, outcome.run, tier_obj, profile)
        if outcome.stall is not None:
            text += f"\n**{'Ended or stuck' if outcome.quiet_end else 'Stalled'}:** {outcome.stall}\n"
        _append(summary, text)
    raise typer.Exit(outcome.exit_code)


def _stall_rule(default: StallRule, multiple: float | None, allowance_minutes: float | None) -> StallRule:
    """The tier's stall rule with the command line's overrides (minutes → seconds); exit 4 on a value the rule
    cannot take."""
    rule = StallRule(default.multiple if multiple is None else multiple,
                     default.startup_allowance_s if allowance_minutes is None else 60.0 * allowance_minutes)
    if rule.multiple != 0 and rule.multiple < 1:
        _fail_input(f"--stall-multiple must be ≥ 1 (or 0: never fail a silent run), got {rule.multiple:g}")
    if rule.startup_allowance_s <= 0:
        _fail_input(f"--startup-allowance must be a positive number of minutes, got {allowance_minutes:g}")
    return rule


@app.command()
def report(
    run: RunArg,
    tier: TierOpt = None,
    profile: ProfileOpt = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", "-o", help="HTML file (default: RUN/report.html, or RUN.report.html beside a log)")] = None,
    markdown: Annotated[Optional[Path], typer.Option(
        "--markdown", help="Markdown summary (default: beside the HTML, .md)")] = None,
    finished: Annotated[Optional[bool], typer.Option("--finished/--running", help="as for check")] = None,
) -> None:
    """Write one self-contained HTML report (plots with the bands, every criterion) and a Markdown summary.

    Exits with the verdict, like check.
    """
    from harness.criteria import evaluate_all
    from harness.report import markdown_summary, write_html_report
    from harness.verdict import exit_code

    data = _read(run, finished)
    tier_obj, _ = _choose_tier(tier, data)
    results = evaluate_all(_criteria(tier_obj, profile), data)
    if out is None:
        out = run / "report.html" if run.is_dir() else run.with_name(run.name + ".report.html")
    markdown = markdown or out.with_suffix(".md")
    write_html_report(out, results, data, tier_obj, profile)
    markdown.write_text(markdown_summary(results, data, tier_obj, profile), encoding="utf-8")
    typer.echo(f"report: {out}\nsummary: {markdown}")
    raise typer.Exit(exit_code(results))


@app.command("criteria")
def list_criteria(
    tier: Annotated[str, typer.Option("--tier", "-t", help="smoke | gpu | 4layer | full, or a spec .toml")] = "full",
) -> None:
    """Print a tier's criteria: what each checks, its numbers, and the recipe sentence it encodes."""
    from rich.table import Table
    from rich.text import Text

    from harness.table import WIDE_CRITERIA, numbers_text, print_criteria_blocks
    from harness.tier import SpecError, load_tier

    try:
        tier_obj = load_tier(tier)
    except SpecError as e:
        _fail_input(str(e))
        raise
    console = _console()
    title = f"{tier_obj.title} ({tier_obj.path})"
    if console.width < WIDE_CRITERIA:  # six columns do not fit: one block per criterion, every sentence whole
        print_criteria_blocks(console, tier_obj.criteria, title)
    else:
        table = Table(title=title, show_lines=True)
        table.add_column("id", style="cyan", no_wrap=True)
        table.add_column("kind", no_wrap=True)
        table.add_column("metric", overflow="fold")
        table.add_column("window", no_wrap=True)
        table.add_column("numbers", no_wrap=True)
        table.add_column("doc", ratio=1, overflow="fold")
        for c in tier_obj.criteria:
            profile = f"\n[profile {c.profile}]" if c.profile else ""
            table.add_row(Text(c.id + profile), c.kind, Text(" | ".join(c.metrics)), str(c.window),
                          Text(numbers_text(c, "\n")), Text(c.doc))
        console.print(table)
    rule = tier_obj.stall
    console.print(Text(f"watch: fails a run silent for {rule.multiple:g} × its median cycle, or "
                       f"{rule.startup_allowance_s / 60:g} min before its first cycle ([watch] of the spec)"
                       if rule.enabled else "watch: stall detection off ([watch] of the spec)", style="dim"))
    console.print(Text("exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items()), style="dim"))


def _append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text + "\n")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
