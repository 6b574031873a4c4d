"""The Workbench's text, and the HTML export's (one home for both): the trace header, the status
line of the current (step, rank, phase), the check verdicts (with a *jump* button per failed
check in the Workbench) and the reload note. Every trace-derived string is HTML-escaped here.

PCP=2 example (``data/traces/cpu-pcp2-mtp2``, step 0, rank 0, phase ``draft_1``): the status
line reads ``step 0 · rank 0 · phase draft_1 (replicated) · N=2, P=26 ... · draft panels show
draft_1``; a failed check adds a red ``✗ check: message`` line at the step of its first violation.
"""

from __future__ import annotations

import html
from typing import Any, Callable, Mapping, Sequence

import ipywidgets as W

from pcpviz.trace import is_valid_phase, phase_sort_key, run_summary
from pcpviz.trace.meta_model import RunMeta
from pcpviz.views import figures as fg
from pcpviz.trace.shapes import view_text

__all__ = ["HEADER_KEYS", "header_html", "status_html", "first_violations", "checks_widget", "checks_table_html",
           "checks_summary", "checks_notes_html", "checks_missing", "CHECKS_UNAVAILABLE", "RELOAD_NOTE"]

HEADER_KEYS = ("producer", "pcp", "dcp", "num_speculative_tokens", "block_size", "model", "device", "inject")
"""The run.json keys the header shows (when set)."""


def header_html(trace: Any, meta: RunMeta, req_ids: Sequence[str]) -> str:
    """The trace's path, steps, ranks, request ids and ``HEADER_KEYS`` of ``meta`` (``Trace.run_meta``)."""
    m = run_summary(meta, HEADER_KEYS)
    items = " · ".join(f"<b>{k}</b> {html.escape(str(v))}" for k, v in m.items() if v not in (None, []))
    return (f"<div style='font-size:13px'><b>trace</b> <code>{html.escape(str(trace.path))}</code> — "
            f"{len(trace.steps)} steps, ranks {trace.ranks}, "
            f"requests {html.escape(fg.shorten(', '.join(map(str, req_ids)), 2000))}"
            f"<br>{items}</div>")


def status_html(where: tuple[int, int, str | None], recs: Mapping[str, Any], *, draft_phase: str | None,
                flags: Sequence[Any], violations: Sequence[Any]) -> str:
    """The line under the controls (the Workbench's and the HTML export's): ``where`` = (step,
    rank, selected phase; None: the export, which lists the step's phases), the layout summary
    of the step's target, the draft phase the draft panels show, its zero/stale block-table rows
    (``flags``) and the first violations at this (step, rank). Every trace-derived string is
    escaped (phase names, views, request ids in the flags, check messages)."""
    step, rank, ph = where
    esc = lambda v: html.escape(str(v))  # noqa: E731
    if ph is None:
        order = sorted(recs, key=lambda p: phase_sort_key(p) if is_valid_phase(p) else (9, 0))
        parts = [f"<b>step {esc(step)}</b> · rank {esc(rank)} · phases {esc(', '.join(map(str, order)))}"]
    else:
        parts = [f"<b>step {esc(step)}</b> · rank {esc(rank)} · phase <b>{esc(ph)}</b>"]
        rec = recs.get(ph)
        if rec is not None and "view" in rec:  # the draft phase's layout view (rank_local / replicated)
            parts[-1] += f" ({esc(view_text(rec['view']))})"
    summary = fg.layout_summary(recs.get("target"))
    if summary:
        parts.append(esc(summary))
    if draft_phase:
        parts.append(f"draft panels show <b>{esc(draft_phase)}</b>")
    line = " · ".join(parts)
    if flags:
        line += (f"<br><span style='color:#c00'>⚠ {len(flags)} {esc(draft_phase or '')} "
                 f"block-table rows are zero/stale: " + "; ".join(esc(f.describe()) for f in flags[:3])
                 + "</span>")
    here = [v for v in violations if v.step == step and (v.rank is None or v.rank == rank)]
    for v in here:
        line += f"<br><span style='color:#c00'>✗ {esc(v.check)}: {esc(v.describe())}</span>"
    return f"<div style='font-size:13px;margin:4px'>{line}</div>"


def first_violations(report: Any) -> list[Any]:
    """The first violation of each failed check of ``report`` (none without a report)."""
    if report is None:
        return []
    return [r.first_violation for r in report.results.values() if getattr(r, "first_violation", None) is not None]


VERDICT_COLORS = {"pass": "#2a7", "fail": "#c00", "skipped": "#888"}


def checks_table_html(report: Any) -> str:
    """The verdict table of ``report``: verdict, check, failed/evaluated, first violation."""
    rows = []
    for name, r in report.results.items():
        color = VERDICT_COLORS.get(r.verdict, "#333")
        first = html.escape(r.first_violation.describe()) if r.first_violation is not None else ""
        rows.append(f"<tr><td style='color:{color};font-weight:bold'>{html.escape(r.verdict.upper())}</td>"
                    f"<td><code>{html.escape(name)}</code></td><td>{r.failed}/{r.evaluated}</td>"
                    f"<td style='font-size:11px'>{first}</td></tr>")
    return ("<table class='checks' style='font-size:12px;border-collapse:collapse' cellpadding='3'>"
            "<tr><th>verdict</th><th>check</th><th>failed/evaluated</th><th>first violation</th></tr>"
            + "".join(rows) + "</table>")


def checks_summary(report: Any) -> tuple[str, bool]:
    """``(text, open)``: the one-line summary of ``report`` (plain text: counts, the first
    violation, the trace's status when it is damaged) and whether it needs attention."""
    text = (f"checks: {report.counts_line()}"
            + (f" — first violation: {report.first_violation.where()}" if report.first_violation else ""))
    status = getattr(report, "status", None)  # pcpviz.trace.validate: whole trace, valid run.json
    problems = [] if status is None else status.lines()
    if problems:
        text = status.summary() + " — " + text
    return ("✗ " if report.failed or problems else "✓ ") + text, bool(report.failed or problems)


def checks_notes_html(report: Any) -> str:
    """The trace's problems (damaged, invalid run.json) and how the run ended, when not complete."""
    status = getattr(report, "status", None)
    problems = [] if status is None else status.lines()
    ending = "" if status is None else getattr(status, "ending", "")
    return ("".join(f"<div style='color:#c00;font-size:12px'>⚠ {html.escape(line)}</div>" for line in problems)
            + (f"<div style='font-size:12px'>run ended: {html.escape(ending)}</div>"
               if ending and ending != "complete" else ""))


CHECKS_UNAVAILABLE = "<i>checks unavailable (pcpviz.analysis.checks not importable)</i>"


def checks_widget(report: Any, violations: Sequence[Any], jump: Callable[[Any], None]) -> tuple[W.Widget | None, list]:
    """``(accordion, jump buttons)``: the verdict table of ``report`` with a button per first
    violation (calling ``jump(violation)``); without a report a note when
    ``pcpviz.analysis.checks`` cannot be imported, else ``None``."""
    if report is None:
        return (W.HTML(CHECKS_UNAVAILABLE) if checks_missing() else None), []
    buttons = []
    for v in violations:
        b = W.Button(description=f"jump: {v.check} (step {v.step}, rank {v.rank}, {v.phase})",
                     button_style="danger", layout=W.Layout(width="auto"))
        b.on_click(lambda _b, v=v: jump(v))
        buttons.append(b)
    summary, attention = checks_summary(report)
    acc = W.Accordion(children=[W.VBox([W.HTML(checks_notes_html(report)),
                                        W.HBox(buttons, layout=W.Layout(flex_flow="row wrap")),
                                        W.HTML(checks_table_html(report))])])
    acc.set_title(0, summary)
    acc.selected_index = 0 if attention else None
    return acc, buttons


def checks_missing() -> bool:
    """True when ``pcpviz.analysis.checks`` cannot be imported."""
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
