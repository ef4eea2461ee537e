"""Reports: one self-contained HTML file (plots embedded as base64 PNG, no external asset) and a Markdown
summary (for CI step summaries). JUnit XML comes from pytest's own ``--junitxml`` through the plugin.
"""

from __future__ import annotations

import base64
import html
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from harness.criteria import Result, Status
from harness.run_data import RunData
from harness.tier import Tier
from harness.verdict import overall

__all__ = ["markdown_summary", "html_report", "write_html_report"]

NEWLINE = "\n"
_ICON = {Status.PASS: "✅", Status.FAIL: "❌", Status.PENDING: "⏳", Status.MISSING: "❔"}
_COLOUR = {Status.PASS: "#2e7d32", Status.FAIL: "#c62828", Status.PENDING: "#ef6c00", Status.MISSING: "#6a1b9a"}


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def markdown_summary(results: Sequence[Result], run: RunData, tier: Tier, profile: str | None = None) -> str:
    """A Markdown table of the verdicts: status, criterion, what was observed, where."""
    verdict = overall(results)
    lines = [f"### k3-harness: {_ICON[verdict]} {verdict} — {tier.title}", "",
             f"Run `{run.source}` ({run.kind}, {'finished' if run.finished else 'running'}), tier `{tier.name}`"
             + (f", profile `{profile}`" if profile else "") + f", {run.events} events.", "",
             "| Status | Criterion | Observed | Where |", "|---|---|---|---|"]
    for r in results:
        status = f"{_ICON[r.status]} {r.status}" + ("" if r.final or r.status is not Status.FAIL else " (may recover)")
        lines.append(f"| {status} | `{r.id}` | {_md_cell(r.summary)} | {_md_cell(r.where or '')} |")
    notes = run.notes()
    if notes:
        lines += ["", "Notes:", ""] + [f"- {_md_cell(n)}" for n in notes]
    if run.problems:
        lines += ["", f"{len(run.problems)} line(s) could not be used (skipped):", ""]
        lines += [f"- `{_md_cell(str(p))}`" for p in run.problems[:20]]
        if len(run.problems) > 20:
            lines.append(f"- … and {len(run.problems) - 20} more")
    return "\n".join(lines) + "\n"


# Train-vs-engine log-prob gaps: plotted apart from the reward, each with its band.
ON_POLICY_METRICS = ("rollout/train_rollout_logprob_abs_diff", "rollout/train_rollout_kl")


def _figures(results: Sequence[Result], run: RunData) -> list[tuple[str, bytes]]:
    from harness import plots

    def pick(test: Callable[[Result], bool]) -> list[Result]:
        return [r for r in results if test(r)]

    def on_policy(r: Result) -> bool:
        return r.criterion.kind == "band" and r.criterion.metric in ON_POLICY_METRICS

    groups = [
        ("Reward per rollout", plots.reward_figure,
         pick(lambda r: r.criterion.kind == "band" and r.criterion.metric.startswith("rollout/") and not on_policy(r))),
        # On-policy (issue #23): one panel per metric, its band per rollout (the same drawing as the reward's)
        *((f"On-policy: {metric} per rollout", plots.reward_figure,
           pick(lambda r, m=metric: on_policy(r) and r.criterion.metric == m)) for metric in ON_POLICY_METRICS),
        ("Evals", plots.eval_figure,
         pick(lambda r: r.criterion.kind in ("band", "rise_by") and r.criterion.metric.startswith("eval/"))),
        ("Memory after every weight sync", plots.memory_figure,
         pick(lambda r: r.criterion.kind in ("returns_to_baseline", "no_growth"))),
        ("Rollout cycle time, and each cycle by phase", plots.cycle_figure,
         pick(lambda r: r.criterion.kind == "cycle_time_within")),
    ]
    out = []
    for title, draw, subset in groups:
        png = draw(subset, run) if subset else None
        if png is not None:
            out.append((title, png))
    return out


_CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1100px;
       color: #212121; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.meta { color: #616161; } table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; vertical-align: top; padding: 6px 8px; border-bottom: 1px solid #eee; }
th { background: #fafafa; } .badge { color: white; border-radius: 4px; padding: 2px 7px; font-weight: 600;
font-size: 12px; white-space: nowrap; } .doc { color: #616161; font-size: 12.5px; } code { font-size: 12.5px; }
figure { margin: 16px 0; } figcaption { font-weight: 600; margin-bottom: 4px; } img { max-width: 100%; }
details { margin: 4px 0; } pre { background: #f5f5f5; padding: 8px; overflow-x: auto; font-size: 12px; }
"""


def _badge(status: Status, final: bool = True) -> str:
    label = str(status) + ("" if final or status is not Status.FAIL else " (may recover)")
    return f'<span class="badge" style="background:{_COLOUR[status]}">{html.escape(label)}</span>'


def html_report(results: Sequence[Result], run: RunData, tier: Tier, profile: str | None = None) -> str:
    """The whole report as one HTML string (images inline)."""
    esc = html.escape
    verdict = overall(results)
    counts = ", ".join(f"{sum(r.status is s for r in results)} {s}" for s in Status
                       if any(r.status is s for r in results))
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>k3-harness: {esc(str(verdict))} — {esc(tier.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_badge(verdict)} {esc(tier.title)}</h1>",
        f"<p class='meta'>Run <code>{esc(run.source)}</code> ({esc(run.kind)}, "
        f"{'finished' if run.finished else 'still running'}) · tier <code>{esc(tier.name)}</code>"
        + (f" · profile <code>{esc(profile)}</code>" if profile else "")
        + f" · {run.events} events · {esc(counts)} · written {esc(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
        f"<p class='doc'>{esc(tier.doc)}<br>Numbers from: {esc(tier.source)}</p>",
        "<h2>Criteria</h2><table><tr><th>Status</th><th>Criterion</th><th>Observed</th><th>Where</th></tr>",
    ]
    for r in results:
        c = r.criterion
        evidence = json.dumps(r.evidence, indent=1, default=str, sort_keys=True)
        if len(evidence) > 4000:
            evidence = evidence[:4000] + "\n…"
        parts.append(
            f"<tr><td>{_badge(r.status, r.final)}</td><td><b>{esc(c.title or c.id)}</b><br><code>{esc(c.id)}</code> "
            f"<span class='doc'>({esc(c.kind)}, window {esc(str(c.window))})</span></td>"
            f"<td>{esc(r.summary).replace(NEWLINE, '<br>')}<div class='doc'>{esc(c.doc)}</div>"
            f"<details><summary class='doc'>evidence</summary><pre>{esc(evidence)}</pre></details></td>"
            f"<td><code>{esc(r.where or '')}</code></td></tr>")
    parts.append("</table>")
    notes = run.notes()
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    figures = _figures(results, run)
    if figures:
        parts.append("<h2>Plots</h2>")
    for title, png in figures:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<figure><figcaption>{esc(title)}</figcaption>"
                     f"<img alt='{esc(title)}' src='data:image/png;base64,{data}'></figure>")
    parts.append(f"<h2>Lines that could not be used ({len(run.problems)})</h2>")
    if run.problems:
        parts.append("<pre>" + esc("\n".join(str(p) for p in run.problems)) + "</pre>")
    else:
        parts.append("<p class='meta'>None: every line the readers looked at parsed.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html_report(path: str | Path, results: Sequence[Result], run: RunData, tier: Tier,
                      profile: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_report(results, run, tier, profile), encoding="utf-8")
    return path
