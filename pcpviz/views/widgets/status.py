"""The Workbench's text: the trace header, the status line of the current (step, rank, phase),
the check verdicts (with a *jump* button per failed check) and the reload note.

PCP=2 example (``data/traces/cpu-pcp2-mtp2``, step 0, rank 0, phase ``draft_1``): the status
line reads ``step 0 · rank 0 · phase draft_1 (replicated) · N=2, P=26 ... · draft panels show
draft_1``; a failed check adds a red ``✗ check: message`` line at the step of its first violation.
"""

from __future__ import annotations

import html
from typing import Any, Callable, Mapping, Sequence

import ipywidgets as W

from pcpviz.trace import run_summary
from pcpviz.views import figures as fg
from pcpviz.trace.shapes import view_text

__all__ = ["HEADER_KEYS", "header_html", "status_html", "first_violations", "checks_widget", "RELOAD_NOTE"]

HEADER_KEYS = ("producer", "pcp", "dcp", "num_speculative_tokens", "block_size", "model", "device", "inject")
"""The run.json keys the header shows (when set)."""


def header_html(trace: Any, meta: Mapping[str, Any], req_ids: Sequence[str]) -> str:
    """The trace's path, steps, ranks, request ids and ``HEADER_KEYS``."""
    m = run_summary(meta, HEADER_KEYS)
    items = " · ".join(f"<b>{k}</b> {html.escape(str(v))}" for k, v in m.items() if v not in (None, []))
    return (f"<div style='font-size:13px'><b>trace</b> <code>{html.escape(str(trace.path))}</code> — "
            f"{len(trace.steps)} steps, ranks {trace.ranks}, "
            f"requests {html.escape(fg.shorten(', '.join(map(str, req_ids)), 2000))}"
            f"<br>{items}</div>")


def status_html(where: tuple[int, int, str], recs: Mapping[str, Any], *, draft_phase: str | None,
                flags: Sequence[Any], violations: Sequence[Any]) -> str:
    """The line under the controls: ``where`` = (step, rank, selected phase), the layout summary
    of the step's target, the draft phase the draft panels show, its zero/stale block-table rows
    (``flags``) and the first violations at this (step, rank)."""
    step, rank, ph = where
    parts = [f"<b>step {step}</b> · rank {rank} · phase <b>{html.escape(str(ph))}</b>"]
    rec = recs.get(ph)
    if rec is not None and "view" in rec:  # the draft phase's layout view (rank_local / replicated)
        parts[-1] += f" ({html.escape(view_text(rec['view']))})"
    summary = fg.layout_summary(recs.get("target"))
    if summary:
        parts.append(html.escape(summary))
    if draft_phase:
        parts.append(f"draft panels show <b>{draft_phase}</b>")
    line = " · ".join(parts)
    if flags:
        line += (f"<br><span style='color:#c00'>⚠ {len(flags)} {html.escape(draft_phase or '')} "
                 f"block-table rows are zero/stale: " + "; ".join(html.escape(f.describe()) for f in flags[:3])
                 + "</span>")
    here = [v for v in violations if v.step == step and (v.rank is None or v.rank == rank)]
    for v in here:
        line += f"<br><span style='color:#c00'>✗ {html.escape(v.check)}: {html.escape(v.describe())}</span>"
    return f"<div style='font-size:13px;margin:4px'>{line}</div>"


def first_violations(report: Any) -> list[Any]:
    """The first violation of each failed check of ``report`` (none without a report)."""
    if report is None:
        return []
    return [r.first_violation for r in report.results.values() if getattr(r, "first_violation", None) is not None]


def checks_widget(report: Any, violations: Sequence[Any], jump: Callable[[Any], None]) -> tuple[W.Widget | None, list]:
    """``(accordion, jump buttons)``: the verdict table of ``report`` with a button per first
    violation (calling ``jump(violation)``); without a report a note when
    ``pcpviz.analysis.checks`` cannot be imported, else ``None``."""
    if report is None:
        return (W.HTML("<i>checks unavailable (pcpviz.analysis.checks not importable)</i>")
                if _checks_missing() else None), []
    rows = []
    for name, r in report.results.items():
        color = {"pass": "#2a7", "fail": "#c00", "skipped": "#888"}.get(r.verdict, "#333")
        first = html.escape(r.first_violation.describe()) if r.first_violation is not None else ""
        rows.append(f"<tr><td style='color:{color};font-weight:bold'>{r.verdict.upper()}</td>"
                    f"<td><code>{html.escape(name)}</code></td><td>{r.failed}/{r.evaluated}</td>"
                    f"<td style='font-size:11px'>{first}</td></tr>")
    table = W.HTML("<table style='font-size:12px;border-collapse:collapse' cellpadding='3'>"
                   "<tr><th>verdict</th><th>check</th><th>failed/evaluated</th><th>first violation</th></tr>"
                   + "".join(rows) + "</table>")
    buttons = []
    for v in violations:
        b = W.Button(description=f"jump: {v.check} (step {v.step}, rank {v.rank}, {v.phase})",
                     button_style="danger", layout=W.Layout(width="auto"))
        b.on_click(lambda _b, v=v: jump(v))
        buttons.append(b)
    summary = (f"checks: {report.counts_line()}"
               + (f" — first violation: {report.first_violation.where()}" if report.first_violation else ""))
    status = getattr(report, "status", None)  # pcpviz.trace.validate: whole trace, valid run.json
    problems = [] if status is None else status.lines()
    if problems:
        summary = status.summary() + " — " + summary
    ending = "" if status is None else getattr(status, "ending", "")
    notes = W.HTML("".join(f"<div style='color:#c00;font-size:12px'>⚠ {html.escape(line)}</div>"
                           for line in problems)
                   + (f"<div style='font-size:12px'>run ended: {html.escape(ending)}</div>"
                      if ending and ending != "complete" else ""))
    acc = W.Accordion(children=[W.VBox([notes, W.HBox(buttons, layout=W.Layout(flex_flow="row wrap")), table])])
    acc.set_title(0, ("✗ " if report.failed or problems else "✓ ") + summary)
    acc.selected_index = 0 if report.failed or problems else None
    return acc, buttons


def _checks_missing() -> bool:
    try:
        import pcpviz.analysis.checks  # noqa: F401, PLC0415
    except ImportError:
        return True
    return False


RELOAD_NOTE = (
    "<style>.pcpviz-reload-note{display:none;color:#c00;font-size:13px;font-weight:bold}"
    ".pcpviz-workbench:not(:has(.js-plotly-plot .hm)) .pcpviz-reload-note{display:block;"
    "animation:pcpviz-late 8s step-end both}"
    "@keyframes pcpviz-late{from{visibility:hidden}to{visibility:visible}}</style>"
    "<div class='pcpviz-reload-note'>⚠ The figures are not drawn: re-run this cell.</div>")
"""One line shown (by CSS alone, 8 s after the Workbench appears) only while none of its figures
has drawn a heatmap. After a page reload with the kernel alive the figures come back drawn
(``pcpviz.views.widgets.figure``); this is the fallback when they cannot (a front end whose
widgets failed to load)."""
