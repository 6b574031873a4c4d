"""``explain(bad, good=None) -> Explanation``: from "acceptance dropped" to the most likely cause.

The evidence, all from existing tools: the checks (``pcpviz.analysis.checks.run_checks``), the diff
against a good run of the same prompts (``pcpviz.analysis.diff.diff_traces``) — when no good run is
given, an engine re-run of the trace's prompts with the same PCP size, K and block size
(``pcpviz.run``) — acceptance per position, per request, per step and per rank
(``pcpviz.analysis.diff.acceptance``), whether the ranks' KV writes agree, and the step of the first
violation. Each fault the engine injects (``pcpviz.faults.faults_of(ENGINE)``) is a hypothesis: its
check failing scores 10, its signature rules (``pcpviz.analysis.explain.rules``) add or take away, and
the hypotheses are ranked. When nothing matches, it says so. A fault the recording can hide
from its check (``pcpviz.analysis.explain.rules.UNSEEN``: vLLM's recorder logs the ids a drafter was
handed, not what a replayed CUDA graph read) is called ``consistent`` when the symptoms fit it.

PCP=2 worked example (``pcpviz run --inject stale_draft_block_table_rows`` on 3 prompts)::

    verdict   FAULT: most likely stale_draft_block_table_rows (ROCm ATOM PR #1593)
    checks    draft_block_tables_global fails first at step 2, draft_1, row 2
    rule      draft block-table rows >= 2 are wrong, rows below 2 always right
    ruled out skip_draft_block_table_gather (row 0 is always right), and every fault whose
              check passes

Verdicts: ``CLEAN`` (checks pass, acceptance level), ``FAULT`` (a fault matches),
``UNEXPLAINED`` (checks fail, no fault's signature matches), ``ACCEPTANCE_REGRESSION`` (checks
pass, acceptance dropped against the reference: no registered fault matches).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from pcpviz.analysis.checks import run_checks
from pcpviz.analysis.diff import diff_traces
from pcpviz.analysis.explain.evidence import Symptoms, gather_symptoms, guarded
from pcpviz.analysis.explain.rules import RULES, UNSEEN, Findings
from pcpviz.faults import ENGINE, FAULTS, faults_of
from pcpviz.trace import Trace
from pcpviz.trace import open as open_trace

__all__ = ["Hypothesis", "Explanation", "explain", "CLEAN", "FAULT", "UNEXPLAINED", "ACCEPTANCE_REGRESSION",
           "MATCH_SCORE", "rerun_plan", "RERUN_MAX_PROMPTS", "RERUN_MAX_NEW_TOKENS", "RERUN_MAX_PROMPT_TOKENS",
           "RERUN_MAX_PCP"]

CLEAN, FAULT, UNEXPLAINED, ACCEPTANCE_REGRESSION = "CLEAN", "FAULT", "UNEXPLAINED", "ACCEPTANCE_REGRESSION"
MATCH_SCORE = 10.0
"""A hypothesis matches when its check fails and its signature rules do not contradict it."""


@dataclass(frozen=True)
class Hypothesis:
    """One registered fault weighed against the evidence."""

    fault: str
    score: float
    status: str  # "matches" | "partial" | "consistent" | "cannot be ruled out" | "ruled out"
    caught_by: str
    models: str
    source: str
    evidence_for: tuple[str, ...]
    evidence_against: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"fault": self.fault, "score": self.score, "status": self.status, "caught_by": self.caught_by,
                "models": self.models, "source": self.source, "evidence_for": list(self.evidence_for),
                "evidence_against": list(self.evidence_against)}


@dataclass(frozen=True)
class Explanation:
    trace: str
    verdict: str
    headline: str
    symptoms: Symptoms
    hypotheses: tuple[Hypothesis, ...]  # best first

    @property
    def ok(self) -> bool:
        """Nothing wrong: checks pass and acceptance did not drop (exit code 0)."""
        return self.verdict == CLEAN and self.symptoms.complete

    @property
    def top(self) -> Hypothesis | None:
        """The best matching hypothesis, or None when no registered fault matches."""
        return self.hypotheses[0] if self.hypotheses and self.hypotheses[0].status == "matches" else None

    def to_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "verdict": self.verdict, "headline": self.headline, "ok": self.ok,
                "top": None if self.top is None else self.top.fault, "symptoms": self.symptoms.to_dict(),
                "hypotheses": [h.to_dict() for h in self.hypotheses]}

    def format(self, max_hypotheses: int = 4) -> str:
        lines = [f"pcpviz explain {self.trace}", f"  verdict: {self.verdict}: {self.headline}"]
        lines += [f"  {line}" for line in self.symptoms.lines()]
        shown = [h for h in self.hypotheses if h.status != "ruled out"][:max_hypotheses]
        if shown:
            lines.append("  hypotheses (best first):")
        for i, h in enumerate(shown, 1):
            lines.append(f"   {i}. {h.fault}  [{h.status}, score {h.score:g}]  caught by {h.caught_by}")
            lines.append(f"      models: {h.models}")
            lines.append(f"      source: {h.source}")
            lines += [f"      + {e}" for e in h.evidence_for]
            lines += [f"      - {e}" for e in h.evidence_against]
        out = [h.fault for h in self.hypotheses if h.status == "ruled out"]
        if out:
            lines.append(f"  ruled out (their check passes): {', '.join(out)}")
        return "\n".join(lines)


def _score(name: str, f: Findings, sym: Symptoms) -> Hypothesis:
    fault = FAULTS[name]
    res = f.report.results.get(fault.caught_by)
    pro: list[str] = []
    con: list[str] = []
    if res is None or res.verdict == "skipped":
        why = res.skip_reason if res is not None else "not run"
        return Hypothesis(name, 0.0, "cannot be ruled out", fault.caught_by, fault.models, fault.source,
                          (), (f"{fault.caught_by} could not run ({why})",))
    if res.verdict != "fail":
        unseen = guarded(UNSEEN[name], f, sym, notes=con, what="signature", default=[]) if name in UNSEEN else []
        if unseen:  # the recording cannot show this fault to its check; the symptoms fit
            return Hypothesis(name, float(sum(w for w, _ in unseen)), "consistent", fault.caught_by, fault.models,
                              fault.source, tuple(why for _, why in unseen),
                              (f"{fault.caught_by} passes on {res.evaluated} (step, rank)",))
        return Hypothesis(name, 0.0, "ruled out", fault.caught_by, fault.models, fault.source, (),
                          (*con, f"{fault.caught_by} passes on {res.evaluated} (step, rank)"))
    score = MATCH_SCORE
    v = res.first_violation
    pro.append(f"{fault.caught_by} fails on {res.failed} of {res.evaluated} (step, rank); first: {v.describe()}")
    first = f.report.first_violation
    if first is not None and v.step == first.step:
        score += 1
        pro.append(f"it fails at the first violating step ({v.step})")
    d = sym.diff_first
    if d is not None and d.get("step") == v.step and d.get("phase") == v.phase and d.get("view") == v.view:
        score += 2
        pro.append(f"the diff's first divergence is the same place (step {v.step}, {v.phase}, {v.view})")
    for weight, why in guarded(RULES[name], f, notes=con, what="signature", default=[]):
        score += weight
        (pro if weight > 0 else con).append(why)
    if sym.outputs_same is not None:
        if fault.changes_outputs != (not sym.outputs_same):
            score -= 1
            con.append("outputs " + ("are the same" if sym.outputs_same else "differ")
                       + " against the reference; the signature says otherwise")
        else:
            pro.append("outputs " + ("are the same" if sym.outputs_same else "differ") + " against the reference, "
                       "as the signature says")
    status = "matches" if score >= MATCH_SCORE else "partial"
    return Hypothesis(name, float(score), status, fault.caught_by, fault.models, fault.source, tuple(pro), tuple(con))


_ORDER = {"matches": 0, "partial": 1, "consistent": 2, "cannot be ruled out": 3, "ruled out": 4}


def _rank(hyps: list[Hypothesis]) -> tuple[Hypothesis, ...]:
    return tuple(sorted(hyps, key=lambda h: (_ORDER[h.status], -h.score, h.fault)))


RERUN_MAX_PROMPTS = 64
"""Most prompts ``explain`` re-runs on the engine (more: give GOOD, or ``--no-rerun``)."""
RERUN_MAX_NEW_TOKENS = 256
"""Most tokens per prompt a re-run generates."""
RERUN_MAX_PROMPT_TOKENS = 1 << 16
"""Most prompt tokens (all prompts together) a re-run prefills."""
RERUN_MAX_PCP = 8
"""Most ranks a re-run starts (CPU processes)."""


def rerun_plan(trace: Trace) -> tuple[dict | None, str]:
    """What ``explain`` would re-run for ``trace`` (``pcpviz.run`` arguments), or None and why
    not: run.json records no prompts, or asks for more than the caps above, or its ``pcp``
    disagrees with the rank files. Read from run.json's schema-valid keys only."""
    from pcpviz.trace.validate import trusted_meta, validate

    m = trusted_meta(trace.meta, validate(trace))
    launch = m.get("launch") if isinstance(m.get("launch"), dict) else {}
    prompts = m.get("prompt_token_ids") or m.get("prompts")
    if not prompts:
        return None, "no re-run: run.json records no prompts (prompt_token_ids / prompts)"
    if isinstance(prompts, dict):  # request id -> prompt
        prompts = list(prompts.values())
    sampling = launch.get("sampling") if isinstance(launch.get("sampling"), dict) else {}
    max_new = m.get("max_new_tokens") or sampling.get("max_tokens") or 32
    kwargs = launch.get("llm_kwargs") if isinstance(launch.get("llm_kwargs"), dict) else {}
    budget = m.get("max_num_batched_tokens") or kwargs.get("max_num_batched_tokens")
    pcp = m.get("pcp") or 1
    ok_prompts = isinstance(prompts, list) and all(
        isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p)) for p in prompts)
    tokens = sum(len(p) for p in prompts) if ok_prompts else 0
    why = ("its prompts are not a list of strings or token-id lists" if not ok_prompts
           else f"{len(prompts)} prompts, more than the {RERUN_MAX_PROMPTS} a re-run runs"
           if len(prompts) > RERUN_MAX_PROMPTS
           else f"{tokens} prompt tokens, more than the {RERUN_MAX_PROMPT_TOKENS} a re-run prefills"
           if tokens > RERUN_MAX_PROMPT_TOKENS
           else f"max_new_tokens {max_new!r}, not an int in 1..{RERUN_MAX_NEW_TOKENS} (what a re-run generates)"
           if type(max_new) is not int or not 1 <= max_new <= RERUN_MAX_NEW_TOKENS
           else f"pcp={pcp}, but the trace has {len(trace.ranks)} rank files" if pcp != len(trace.ranks)
           else f"pcp={pcp}, more than the {RERUN_MAX_PCP} ranks a re-run starts" if pcp > RERUN_MAX_PCP
           else f"max_num_batched_tokens {budget!r} is not an int in 1..{1 << 20}"
           if budget is not None and (type(budget) is not int or not 1 <= budget <= 1 << 20) else None)
    if why:
        return None, f"no re-run: run.json asks for {why}; give GOOD (a good run) or pass --no-rerun"
    opts = {"max_num_batched_tokens": budget} if budget else {}
    if m.get("dtype") in ("float32", "bfloat16"):
        opts["dtype"] = m["dtype"]
    return dict(prompts=prompts, pcp=pcp, num_speculative_tokens=m.get("num_speculative_tokens") or 0,
                block_size=m.get("block_size") or 16, max_new_tokens=max_new, **opts), ""


def _rerun(trace: Trace, out_dir: str) -> tuple[str | None, str]:
    """Re-run the trace's prompts on the engine (same PCP, K, block size); (trace dir, note)."""
    import pcpviz

    plan, why = rerun_plan(trace)
    if plan is None:
        return None, why
    prompts = plan.pop("prompts")
    try:
        pcpviz.run(prompts, trace_dir=out_dir, progress=False, **plan)
    except (ValueError, RuntimeError, OSError) as e:
        return None, f"no re-run: {' '.join(str(e).split())}"
    return out_dir, (f"reference: a clean engine re-run of the same {len(prompts)} prompts "
                     f"(PCP {plan['pcp']}, K {plan['num_speculative_tokens']}, block size {plan['block_size']})")


def explain(bad: Trace | str | os.PathLike, good: Trace | str | os.PathLike | None = None, *,
            rerun: bool = True) -> Explanation:
    """Explain ``bad`` (see the module doc). ``good``: a good run of the same prompts; without it,
    ``rerun=True`` re-runs the prompts on the engine as the reference (``rerun=False``: none)."""
    tb = bad if isinstance(bad, Trace) else open_trace(bad)
    report = run_checks(tb)
    with tempfile.TemporaryDirectory(prefix="pcpviz-explain-") as tmp:
        note = None
        ref = good
        kind = "good" if good is not None else None
        if ref is None and rerun:
            ref, note = _rerun(tb, os.path.join(tmp, "rerun"))
            kind = "rerun" if ref is not None else None
        ta = None if ref is None else (ref if isinstance(ref, Trace) else open_trace(ref))
        diff = None if ta is None else diff_traces(ta, tb)
        sym = gather_symptoms(tb, report, diff, reference_trace=ta, reference_kind=kind, note=note)
    f = Findings(tb, report)
    hyps = _rank([_score(name, f, sym) for name in faults_of(ENGINE)])
    verdict, headline = _verdict(report, sym, hyps)
    if not report.complete:
        headline += "; the trace is INCOMPLETE (data lost): this covers only the steps that are left"
    return Explanation(str(tb.path), verdict, headline, sym, hyps)


def _rate(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def _pos0(sym: Symptoms) -> str:
    if not sym.rate_per_position or not sym.reference_rate_per_position:
        return ""
    return f"; position 0: {_rate(sym.rate_per_position[0])} vs {_rate(sym.reference_rate_per_position[0])}"


def _where(sym: Symptoms) -> str:
    d = sym.drafts_first_differ
    if d is None:
        return ""
    out = f". The drafts first differ at step {d['step']} ({d['phase']})"
    if sym.only_layout_before_drafts and sym.differs_before_drafts:
        out += (", after differences only in the rank-local layout and its padding; suspect an input the "
                "trace does not record (what the drafter consumed rather than what it was handed)")
    return out


def _verdict(report, sym: Symptoms, hyps: tuple[Hypothesis, ...]) -> tuple[str, str]:
    top = hyps[0] if hyps and hyps[0].status == "matches" else None
    unknown = [h.fault for h in hyps if h.status == "cannot be ruled out"]
    fits = [h.fault for h in hyps if h.status == "consistent"]
    tail = f"; cannot be ruled out (their check could not run): {', '.join(unknown)}" if unknown else ""
    if fits:
        tail += (f"; consistent with {', '.join(fits)} (the symptoms fit, and this recording cannot show "
                 f"it to its check)")
    if top is not None:
        return FAULT, (f"most likely {top.fault} — {top.models} ({top.source.split(' (')[0]}); "
                       f"caught by {top.caught_by}")
    if report.failed:
        return UNEXPLAINED, (f"checks fail ({', '.join(report.failed[:4])}) but no registered fault's "
                             f"signature matches{tail}")
    if sym.acceptance_dropped:
        same = {True: ", same outputs", False: ", outputs differ", None: ""}[sym.outputs_same]
        return ACCEPTANCE_REGRESSION, (
            f"acceptance dropped (rate {_rate(sym.acceptance_rate)} vs {_rate(sym.reference_acceptance_rate)} in the "
            f"reference{_pos0(sym)}{same}) and every check passes: no registered fault matches (none's check "
            f"fails){tail}{_where(sym)}")
    return CLEAN, "every check passes" + (
        f" and acceptance is level with the reference ({_rate(sym.acceptance_rate)} vs "
        f"{_rate(sym.reference_acceptance_rate)})" if sym.reference_acceptance_rate is not None else
        " (no reference to compare acceptance with)") + ": nothing to blame" + tail
