"""``explain(bad, good=None) -> Explanation``: from "acceptance dropped" to the most likely cause.

The evidence, all from existing tools: the checks (``pcpviz.analysis.checks.run_checks``), the diff
against a good run of the same prompts (``pcpviz.analysis.diff.diff_traces``) — when no good run is
given, an engine re-run of the trace's prompts with the same PCP size, K and block size
(``pcpviz.run``) — acceptance per position, per request, per step and per rank
(``pcpviz.analysis.diff.acceptance``), whether the ranks' KV writes agree, and the step of the first
violation. Each fault the engine injects (``pcpviz.faults.faults_of(ENGINE)``) is a hypothesis
that ``matches`` only by confirmation: its check fails, a predicate specific to it
(``pcpviz.analysis.explain.rules``) confirms its exact signature, and nothing contradicts it (a
contradicting predicate, a first wrong view that comes before its check fails, different
outputs for a fault that changes only drafts). An inconclusive predicate confirms nothing. When
no fault is confirmed the verdict names the mechanism (``pcpviz.analysis.explain.mechanism``):
the first wrong view against its expected value, the steps and ranks affected, whether tokens
changed, which faults are merely consistent, and how sure it is. A fault the recording can hide
from its check (``UNSEEN``: vLLM's recorder logs the ids a drafter was handed, not what a
replayed CUDA graph read) is at most ``consistent``.

PCP=2 worked example (``pcpviz run --inject stale_draft_block_table_rows`` on 3 prompts)::

    verdict   FAULT: stale_draft_block_table_rows (ROCm ATOM PR #1593)
    checks    draft_block_tables_global fails first at step 2, draft_1, row 2
    confirmed draft block-table rows >= 2 are wrong, rows below 2 always right, every wrong row stale
    ruled out skip_draft_block_table_gather (row 0 is always right), and every fault whose
              check passes

Verdicts: ``CLEAN`` (checks pass and the run equals the reference, or there is none),
``FAULT`` (a fault is confirmed), ``UNEXPLAINED`` (checks fail, no fault confirmed: the
mechanism), ``ACCEPTANCE_REGRESSION`` (checks pass, acceptance dropped against the reference),
``DIVERGED`` (checks pass, acceptance level, but drafts, tokens or views differ). Never CLEAN
when anything differs from the reference.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from pcpviz.analysis.acceptance import AcceptanceFold
from pcpviz.analysis.checks import run_checks
from pcpviz.analysis.diff import diff_traces
from pcpviz.analysis.explain.evidence import KvReplicas, Symptoms, gather_symptoms, guarded
from pcpviz.analysis.checks.report import violation_order
from pcpviz.analysis.explain.mechanism import mechanism
from pcpviz.analysis.explain.rules import NOTHING, RULES, UNSEEN, Findings
from pcpviz.analysis.producers import Attribution, attribute_divergence, attribute_violation
from pcpviz.faults import ENGINE, FAULTS, faults_of
from pcpviz.trace import Trace
from pcpviz.trace import open as open_trace

__all__ = ["Hypothesis", "Explanation", "explain", "CLEAN", "FAULT", "UNEXPLAINED", "ACCEPTANCE_REGRESSION",
           "DIVERGED", "rerun_plan", "other_producer", "RERUN_MAX_PROMPTS", "RERUN_MAX_NEW_TOKENS",
           "RERUN_MAX_PROMPT_TOKENS", "RERUN_MAX_PCP"]

CLEAN, FAULT, UNEXPLAINED, ACCEPTANCE_REGRESSION = "CLEAN", "FAULT", "UNEXPLAINED", "ACCEPTANCE_REGRESSION"
DIVERGED = "DIVERGED"
"""Every check passes, acceptance did not drop, but drafts, tokens or views differ from the reference."""


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
    producer: Attribution | None = None  # who wrote the first wrong (or divergent) value

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
                "hypotheses": [h.to_dict() for h in self.hypotheses],
                "producer": None if self.producer is None else self.producer.to_dict()}

    def format(self, max_hypotheses: int = 4) -> str:
        lines = [f"pcpviz explain {self.trace}", f"  verdict: {self.verdict}: {self.headline}"]
        lines += [f"  {line}" for line in self.symptoms.lines()]
        if self.producer is not None:
            lines.append(f"  producer: {self.producer.line()}")
        shown = [h for h in self.hypotheses if h.status != "ruled out"][:max_hypotheses]
        if shown:
            lines.append("  hypotheses (best first):")
        for i, h in enumerate(shown, 1):
            lines.append(f"   {i}. {h.fault}  [{h.status}]  caught by {h.caught_by}")
            lines.append(f"      models: {h.models}")
            lines.append(f"      source: {h.source}")
            lines += [f"      + {e}" for e in h.evidence_for]
            lines += [f"      - {e}" for e in h.evidence_against]
        passing = [h.fault for h in self.hypotheses if h.status == "ruled out" and not h.evidence_for]
        contradicted = [h for h in self.hypotheses if h.status == "ruled out" and h.evidence_for]
        for h in contradicted:
            lines.append(f"  ruled out {h.fault} (its check fails, but): {h.evidence_against[0]}")
        if passing:
            lines.append(f"  ruled out (their check passes): {', '.join(passing)}")
        return "\n".join(lines)


def _located_after(v, first) -> bool:
    """``v`` (a fault's own check's first violation) comes after the trace's first wrong view."""
    return first is not None and violation_order(v)[:2] > violation_order(first)[:2]


def _hypothesis(name: str, f: Findings, sym: Symptoms) -> Hypothesis:
    """``matches`` only when the fault's check fails, a predicate specific to it confirms it and
    nothing contradicts it; ``consistent`` when its check fails (or, for a fault the recording
    hides, its symptoms fit) but nothing specific confirms it; ``ruled out`` otherwise."""
    fault = FAULTS[name]
    res = f.report.results.get(fault.caught_by)
    con: list[str] = []
    if res is None or res.verdict == "skipped":
        why = res.skip_reason if res is not None else "not run"
        return Hypothesis(name, 0.0, "cannot be ruled out", fault.caught_by, fault.models, fault.source,
                          (), (f"{fault.caught_by} could not run ({why})",))
    if res.verdict != "fail":
        sig = guarded(UNSEEN[name], f, sym, notes=con, what="signature", default=NOTHING) if name in UNSEEN \
            else NOTHING
        passes = f"{fault.caught_by} passes on {res.evaluated} (step, rank)"
        if sig.confirms and not sig.contradicts:  # the recording cannot show this fault to its check
            return Hypothesis(name, float(len(sig.confirms)), "consistent", fault.caught_by, fault.models,
                              fault.source, sig.confirms, (passes,))
        return Hypothesis(name, 0.0, "ruled out", fault.caught_by, fault.models, fault.source, (),
                          (*con, *sig.contradicts, passes))
    v = res.first_violation
    pro = [f"{fault.caught_by} fails on {res.failed} of {res.evaluated} (step, rank); first: {v.describe()}"]
    sig = guarded(RULES[name], f, notes=con, what="signature", default=NOTHING)
    con += sig.contradicts
    first = f.report.first_violation
    if _located_after(v, first):
        con.append(f"the first wrong view ({first.check}: step {first.step}, {first.phase}, {first.view}) comes "
                   f"before {fault.caught_by} first fails (step {v.step}, {v.phase})")
    if sym.outputs_same is False and not fault.changes_outputs:
        con.append("the outputs differ from the reference; this fault changes only the drafts")
    status = "ruled out" if con else "matches" if sig.confirms else "consistent"
    return Hypothesis(name, float(len(sig.confirms)), status, fault.caught_by, fault.models, fault.source,
                      tuple(pro) + sig.confirms, tuple(con))


_ORDER = {"matches": 0, "partial": 1, "consistent": 2, "cannot be ruled out": 3, "ruled out": 4}


def _rank(hyps: list[Hypothesis], report) -> tuple[Hypothesis, ...]:
    def where(h: Hypothesis) -> tuple:
        r = report.results.get(h.caught_by)
        v = None if r is None else r.first_violation
        return (1, ()) if v is None else (0, violation_order(v))
    return tuple(sorted(hyps, key=lambda h: (_ORDER[h.status], where(h), -h.score, h.fault)))


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
    from pcpviz.trace.meta_model import thawed_json
    from pcpviz.trace.validate import trusted_meta, validate

    m = trusted_meta(trace.run_meta, validate(trace))
    prompts = thawed_json(m.prompt_token_ids or m.prompts)
    if not prompts:
        return None, "no re-run: run.json records no prompts (prompt_token_ids / prompts)"
    if isinstance(prompts, dict):  # request id -> prompt
        prompts = list(prompts.values())
    max_new = m.max_tokens or 32
    kwargs = m.launch.llm_kwargs if m.launch is not None else {}
    budget = m.max_num_batched_tokens or kwargs.get("max_num_batched_tokens")
    pcp = m.pcp or 1
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
    if m.dtype in ("float32", "bfloat16"):
        opts["dtype"] = m.dtype
    if m.dcp_group == "pcp" and m.dcp > 1:  # the engine's own DCP
        opts.update(dcp=m.dcp, dcp_interleave=m.dcp_interleave)
    return dict(prompts=prompts, pcp=pcp, num_speculative_tokens=m.num_speculative_tokens or 0,
                block_size=m.block_size or 16, max_new_tokens=max_new, **opts), ""


def other_producer(trace: Trace) -> str | None:
    """Why an engine re-run on this CPU is another producer than the one that wrote ``trace``
    (real vLLM, a GPU, another dtype), else None. Such a re-run schedules, rounds and samples on
    its own terms: only what must agree across producers (the checks, the prompts) is compared."""
    m = trace.run_meta
    if m.producer != "pcpviz-engine":
        return f"the trace comes from {m.producer or 'an unnamed producer'}, the re-run from pcpviz's engine"
    if (m.device or "cpu") != "cpu":
        return f"the trace ran on {m.device}, the re-run on CPU"
    return None


def _rerun(trace: Trace, out_dir: str, *, progress: bool = False) -> tuple[str | None, str]:
    """Re-run the trace's prompts on the engine (same PCP, K, block size); (trace dir, note)."""
    import pcpviz

    plan, why = rerun_plan(trace)
    if plan is None:
        return None, why
    prompts = plan.pop("prompts")
    try:
        pcpviz.run(prompts, trace_dir=out_dir, progress=progress, **plan)
    except (ValueError, RuntimeError, OSError) as e:
        return None, f"no re-run: {' '.join(str(e).split())}"
    return out_dir, (f"reference: a clean engine re-run of the same {len(prompts)} prompts "
                     f"(PCP {plan['pcp']}, K {plan['num_speculative_tokens']}, block size {plan['block_size']})")


def explain(bad: Trace | str | os.PathLike, good: Trace | str | os.PathLike | None = None, *,
            rerun: bool = True, status: Any = None, progress: bool = False) -> Explanation:
    """Explain ``bad`` (see the module doc). ``good``: a good run of the same prompts; without it,
    ``rerun=True`` re-runs the prompts on the engine as the reference (``rerun=False``: none;
    ``progress``: the re-run's progress bar). A re-run by another producer (``other_producer``:
    real vLLM, a GPU) is no reference for views, tokens or acceptance: its differences are noted,
    never the verdict. ``status``: ``pcpviz.trace.validate(bad)`` when the caller has it already."""
    tb = bad if isinstance(bad, Trace) else open_trace(bad)
    kv = KvReplicas(tb.ranks[0] if tb.ranks else None)
    fold = AcceptanceFold.of(tb)
    report = run_checks(tb, status=status, probe=kv.probe,  # one pass: the checks, the KV replicas, acceptance
                        folds={"acceptance": fold} if fold is not None else None)
    kv.take(report.probe)
    with tempfile.TemporaryDirectory(prefix="pcpviz-explain-") as tmp:
        note = None
        ref = good
        kind = "good" if good is not None else None
        if ref is None and rerun:
            ref, note = _rerun(tb, os.path.join(tmp, "rerun"), progress=progress)
            kind = "rerun" if ref is not None else None
        ta = None if ref is None else (ref if isinstance(ref, Trace) else open_trace(ref))
        diff = None if ta is None else diff_traces(ta, tb)
        sym = gather_symptoms(tb, report, diff, reference_trace=ta, reference_kind=kind, note=note, kv=kv)
        who = attribute_violation(tb, report)
        if who is None and diff is not None:
            who = attribute_divergence(tb, diff)
    f = Findings(tb, report)
    hyps = _rank([_hypothesis(name, f, sym) for name in faults_of(ENGINE)], report)
    verdict, headline = _verdict(report, sym, hyps)
    other = other_producer(tb) if kind == "rerun" else None
    if other is not None and verdict in (DIVERGED, ACCEPTANCE_REGRESSION):
        headline = (f"every check passes; the engine re-run differs ({verdict.lower().replace('_', ' ')}: "
                    f"{headline}), but {other}: scheduling, rounding and sampling differ by producer, so "
                    "that is no evidence against this run (give GOOD, a good run by the same producer, "
                    "to compare views and acceptance)")
        verdict = CLEAN
        if not report.failed:
            who = None  # no wrong value: naming the function that wrote a cross-producer difference would blame it
    if not report.complete:
        ending = getattr(report.status, "ending", "")
        why = {"being written": "it is still being written",
               "unfinished": "the run did not finish: killed or crashed?"}.get(ending) or (
            f"the run stopped early: {ending.removeprefix('partial: ')}" if ending.startswith("partial")
            else "data lost")
        headline += f"; the trace is INCOMPLETE ({why}): this covers only the steps that are left"
    return Explanation(str(tb.path), verdict, headline, sym, hyps, who)


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
    if top is not None:
        return FAULT, (f"{top.fault} — {top.models} ({top.source.split(' (')[0]}); caught by {top.caught_by}; "
                       f"confirmed: {top.evidence_for[-1]}; sure: its own signature is seen and nothing "
                       "contradicts it")
    if report.failed:
        return UNEXPLAINED, mechanism(report, sym, hyps)
    if sym.acceptance_dropped:
        same = {True: ", same outputs", False: ", outputs differ", None: ""}[sym.outputs_same]
        return ACCEPTANCE_REGRESSION, (
            f"acceptance dropped (rate {_rate(sym.acceptance_rate)} vs {_rate(sym.reference_acceptance_rate)} in the "
            f"reference{_pos0(sym)}{same}) and every check passes: no registered fault matches (none's check "
            f"fails){_tail(hyps)}{_where(sym)}")
    if sym.diff_first is not None or sym.outputs_same is False:
        return DIVERGED, mechanism(report, sym, hyps)
    return CLEAN, "every check passes" + (
        f", the run equals the reference and acceptance is level ({_rate(sym.acceptance_rate)} vs "
        f"{_rate(sym.reference_acceptance_rate)})" if sym.reference_acceptance_rate is not None else
        " (no reference to compare with)") + ": nothing to blame" + _tail(hyps)


def _tail(hyps: tuple[Hypothesis, ...]) -> str:
    unknown = [h.fault for h in hyps if h.status == "cannot be ruled out"]
    fits = [h.fault for h in hyps if h.status == "consistent"]
    tail = f"; cannot be ruled out (their check could not run): {', '.join(unknown)}" if unknown else ""
    if fits:
        tail += (f"; consistent with {', '.join(fits)} (the symptoms fit, and this recording cannot show "
                 f"it to its check)")
    return tail
