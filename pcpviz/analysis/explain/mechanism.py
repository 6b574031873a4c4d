"""What ``explain`` says when no catalogued fault is confirmed: the mechanism, from the evidence.

``mechanism(report, symptoms, hypotheses) -> str`` names the first wrong view (the earliest
violation over every check, in causal order: step, then target / verify / draft_0 / draft_1 ...,
then rank) with its expected and actual values, the steps and ranks the failing checks cover,
whether the tokens changed or only acceptance, which faults are merely consistent (their check
fails but nothing specific to them is seen) or ruled out, and how sure the answer is.

PCP=2 example: a bug that hands draft_1 the block-table row of the request before it::

    UNEXPLAINED: first wrong view: step 1, phase draft_1, view block_table_draft, rank 0,
    index [0, 1, 0]: expected [[5, 9]], actual [[3, 0]] (draft_block_tables_global: draft decode
    block-table row != the request's global row); draft_block_tables_global fails on 20 (step,
    rank), steps 1-10, ranks 0, 1; tokens unchanged against the reference, acceptance 0.41 vs
    0.62; consistent with: nothing; ruled out: stale_draft_block_table_rows (row 1 holds
    another request's blocks) ...; sure of: the first wrong view (a recorded value differs from
    what the step's own inputs imply); not sure of: the cause (no catalogued fault's own
    signature is confirmed)
"""

from __future__ import annotations

import math

__all__ = ["mechanism", "spans"]


def spans(values) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    vs = sorted(set(int(v) for v in values))
    out, i = [], 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        out.append(str(vs[i]) if i == j else f"{vs[i]}-{vs[j]}")
        i = j + 1
    return ", ".join(out)


def _rate(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def _first_view(report) -> str:
    v = report.first_violation
    if v is None:
        return ""
    out = f"first wrong view: {v.where()}"
    if v.expected is not None or v.actual is not None:
        out += f": expected {v.expected}, actual {v.actual}"
    res = report.results[v.check]
    steps = sorted({s for s, _ in res.failures})
    ranks = sorted({r for _, r in res.failures})
    out += (f" ({v.check}: {v.message}); {v.check} fails on {res.failed} (step, rank)"
            + (f", steps {spans(steps)}, ranks {spans(ranks)}" if steps else ""))
    others = [n for n in report.failed if n != v.check]
    if others:
        out += f"; also failing: {', '.join(others[:5])}"
    return out


def _diverged(sym) -> str:
    d = sym.diff_first
    if d is None:
        return ""
    out = (f"every check passes, but the run differs from the reference ({sym.reference_kind}) from step "
           f"{d['step']}, phase {d['phase']}, view {d['view']}")
    if d.get("rank") is not None:
        out += f", rank {d['rank']}"
    if sym.drafts_first_differ is not None:
        dd = sym.drafts_first_differ
        out += f"; the drafts first differ at step {dd['step']} ({dd['phase']})"
    other = [n for n in sym.notes if "producer" in n]
    if other:
        out += (f" ({other[0]}: another producer schedules and rounds differently, so a difference "
                "here is expected as well as possible)")
    return out


def _tokens(sym) -> str:
    if sym.outputs_same is None:
        return "tokens: no reference to compare with" if sym.reference is None else "tokens: not comparable"
    what = "tokens unchanged (only the drafts / acceptance moved)" if sym.outputs_same else "tokens CHANGED"
    return (f"{what} against the reference; acceptance {_rate(sym.acceptance_rate)} vs "
            f"{_rate(sym.reference_acceptance_rate)}")


def _check_passes(report, name: str) -> bool:
    res = report.results.get(name)
    return res is not None and res.verdict == "pass"


def mechanism(report, sym, hyps) -> str:
    """The mechanism text (see the module doc); ``hyps`` are ``explain``'s ranked hypotheses."""
    parts = [_first_view(report) or _diverged(sym), _tokens(sym)]
    fits = [h for h in hyps if h.status == "consistent"]
    hidden = [h for h in fits if _check_passes(report, h.caught_by)]  # the recording hides them from it
    out = [h for h in hyps if h.status == "ruled out" and h.evidence_for]
    parts.append("merely consistent (their check fails, nothing specific to them is seen): "
                 + (", ".join(h.fault for h in fits if h not in hidden) or "none"))
    if hidden:
        parts.append("consistent, though this recording hides them from their own check: "
                     + "; ".join(f"{h.fault} ({h.evidence_for[0]})" if h.evidence_for else h.fault for h in hidden))
    if out:
        parts.append("ruled out although their check fails: "
                     + "; ".join(f"{h.fault} ({h.evidence_against[0]})" for h in out[:4]))
    if report.failed:
        parts.append("sure of: the first wrong view (a recorded value differs from what the step's own "
                     "inputs and the reference arithmetic imply); not sure of: the cause (no catalogued "
                     "fault's own signature is confirmed) - start at that view's producer")
    else:
        parts.append("sure of: the runs differ; not sure of: where (no check sees a wrong value, so the "
                     "difference comes from something the trace does not record, or a numerics change)")
    return "; ".join(p for p in parts if p)
