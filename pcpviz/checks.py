"""Invariants over a trace: ``run_checks(trace) -> CheckReport``.

Each check is a small named function over one (step, rank): it reads the views it needs
from that rank's phases (and, for the cross-step and cross-rank checks, the previous step
or the other ranks), and either passes, is *skipped* because an input view was not
recorded (``"no <view>"``), or reports a violation: step, rank, phase, view, the first
differing index, expected and actual (short windows around that index). The names are
stable — tests, the engine's fault catalogue (``pcpviz.engine.faults``) and users rely on
them; ``CHECKS`` maps each name to its one-line meaning.

The rules are vLLM 0.33.0's (``docs/vllm-0.33-pcp-mtp.md#invariants``). A PCP=2 step that
passes everything, drawn (K=2, block_size 4; rank 0 shown)::

    global      d0: positions 20..22 (1 + 2 drafts)   p1: fresh prefill 0..8        T = 12
    layout      plan_layout([3, 9], [F, T], 2) == the recorded segments/maps/mask
    gathered    slot_mapping_gathered[:, j] == slot_mapping_global[:, padded_gather_idx[j]]
                where kv_write_mask[j], PAD elsewhere; non-PAD slots unique, == global's
    local       local_positions[:n] == positions[padded_gather_idx[r*P : r*P+n]]
    sampling    sampled_logits_rows == logits_indices (global rows), sampled_from == "global"
    draft_0     rank_local: the target's local rows, gathered slot mapping ([G, N*P])
    draft_1     replicated: block_table_draft == block_table_global, slot mapping [G, R]
                == slots of the global rows at draft_positions == positions[last] + 1
    verify      identical on every rank; the next step starts each request at
                first position + q - num_rejected

Everything is vectorised NumPy over one step's arrays; ``benchmarks/bench_checks.py``
times a 32k-token PCP=4 trace.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

import numpy as np

from pcpviz.trace.schema import causal_phase_key
from pcpviz.blocks import PAD_SLOT_ID, compute_slot_mappings
from pcpviz.layout import plan_layout, replicated_requests
from pcpviz.trace import SEGMENT_DTYPE, Trace, draft_index, segments_table
from pcpviz.trace import open as open_trace
from pcpviz.trace.validate import TraceStatus, trusted_meta
from pcpviz.trace.validate import validate as validate_trace

__all__ = [
    "CHECKS", "PASS", "FAIL", "SKIPPED", "Violation", "CheckResult", "CheckReport", "run_checks",
    "first_difference", "short_repr",
]

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"

TIMING_VIEWS = frozenset({"t_start_us", "t_end_us"})
DIGEST_VIEWS = frozenset({"top1_token", "hidden_hash"})


# --------------------------------------------------------------------------- report records

@dataclass(frozen=True)
class Violation:
    """The first place a check found the trace wrong."""

    check: str
    step: int
    rank: int | None
    phase: str | None
    view: str | None
    message: str
    index: tuple[int, ...] | None = None  # first differing index into the recorded view
    expected: str | None = None  # short repr (a window around ``index``)
    actual: str | None = None

    def where(self) -> str:
        parts = [f"step {self.step}"]
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.phase is not None:
            parts.append(f"phase {self.phase}")
        if self.view is not None:
            parts.append(f"view {self.view}")
        if self.index is not None:
            parts.append(f"index {list(self.index)}")
        return ", ".join(parts)

    def describe(self) -> str:
        out = f"{self.where()}: {self.message}"
        if self.expected is not None or self.actual is not None:
            out += f"; expected {self.expected}, actual {self.actual}"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "step": self.step, "rank": self.rank, "phase": self.phase,
                "view": self.view, "index": None if self.index is None else list(self.index),
                "message": self.message, "expected": self.expected, "actual": self.actual}


@dataclass(frozen=True)
class CheckResult:
    """One check over the whole trace."""

    name: str
    description: str
    verdict: str  # PASS | FAIL | SKIPPED (ran on no (step, rank))
    evaluated: int  # (step, rank) pairs the check ran on
    failed: int  # of those, how many had a violation
    skipped: int  # (step, rank) pairs where an input was missing
    skip_reason: str | None  # the first reason, "step S rank R: no <view>"
    first_violation: Violation | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "verdict": self.verdict,
                "evaluated": self.evaluated, "failed": self.failed, "skipped": self.skipped,
                "skip_reason": self.skip_reason,
                "first_violation": None if self.first_violation is None else self.first_violation.to_dict()}


@dataclass(frozen=True)
class CheckReport:
    """``run_checks``'s answer: one ``CheckResult`` per check, in catalogue order."""

    trace: str
    meta: Mapping[str, Any]  # the run.json keys that matter to the checks
    steps: int
    ranks: tuple[int, ...]
    results: Mapping[str, CheckResult]
    seconds: float
    status: TraceStatus = TraceStatus()  # pcpviz.trace.validate: run.json valid, trace complete

    @property
    def ok(self) -> bool:
        """No check failed (skipped checks do not count as failures) and the trace is whole
        with a valid run.json (``status``)."""
        return not self.failed and self.status.ok

    @property
    def complete(self) -> bool:
        """No data lost (``status.complete``): every rank readable, every step on every rank."""
        return self.status.complete

    @property
    def failed(self) -> list[str]:
        return [n for n, r in self.results.items() if r.verdict == FAIL]

    @property
    def passed(self) -> list[str]:
        return [n for n, r in self.results.items() if r.verdict == PASS]

    @property
    def skipped(self) -> list[str]:
        return [n for n, r in self.results.items() if r.verdict == SKIPPED]

    @property
    def first_violation(self) -> Violation | None:
        """The earliest violation over all checks (by step, then rank, then catalogue order)."""
        found = [r.first_violation for r in self.results.values() if r.first_violation is not None]
        if not found:
            return None
        return min(found, key=lambda v: (v.step, -1 if v.rank is None else v.rank))

    def __getitem__(self, name: str) -> CheckResult:
        return self.results[name]

    def to_dict(self) -> dict[str, Any]:
        return {"trace": self.trace, "ok": self.ok, "meta": dict(self.meta), "steps": self.steps,
                "ranks": list(self.ranks), "seconds": round(self.seconds, 4),
                "summary": {"passed": len(self.passed), "failed": len(self.failed),
                            "skipped": len(self.skipped)},
                **self.status.to_dict(),
                "checks": {n: r.to_dict() for n, r in self.results.items()}}

    def format(self) -> str:
        """A text report: one line per check, the first violation under each failure."""
        m = self.meta
        lines = [f"pcpviz check {self.trace}",
                 f"  producer {m.get('producer')}, pcp {m.get('pcp')}, dcp {m.get('dcp')}, "
                 f"K {m.get('num_speculative_tokens')}, block_size {m.get('block_size')}, "
                 f"{self.steps} steps, ranks {list(self.ranks)}"]
        width = max((len(n) for n in self.results), default=10)
        for name, r in self.results.items():
            total = r.evaluated + r.skipped
            if r.verdict == FAIL:
                lines.append(f"  FAIL  {name:<{width}}  {r.failed} of {r.evaluated} (step, rank) failed")
                lines.append(f"        first: {r.first_violation.describe()}")
            elif r.verdict == PASS:
                extra = f"; skipped {r.skipped} ({r.skip_reason})" if r.skipped else ""
                lines.append(f"  PASS  {name:<{width}}  {r.evaluated}/{total} (step, rank){extra}")
            else:
                lines.append(f"  SKIP  {name:<{width}}  ran on 0 of {total} (step, rank): {r.skip_reason}")
        lines += [f"  {line}" for line in self.status.lines()]
        verdict = ("INCOMPLETE" if not self.status.complete else "INVALID" if not self.status.valid
                   else "FAIL" if self.failed else "OK")
        lines.append(f"  result: {verdict}: {len(self.passed)} passed, {len(self.failed)} failed, "
                     f"{len(self.skipped)} skipped (could run on no step) in {self.seconds:.2f} s")
        return "\n".join(lines)


# --------------------------------------------------------------------------- short reprs

def _fmt(x: Any) -> str:
    if isinstance(x, (np.str_, str)):
        return repr(str(x))
    if isinstance(x, (np.bool_, bool)):
        return "T" if x else "F"
    if isinstance(x, np.floating):
        return f"{float(x):g}"
    if isinstance(x, np.void):
        return "(" + ",".join(str(v) for v in x.tolist()) + ")"
    return str(x.item() if isinstance(x, np.generic) else x)


def short_repr(arr: Any, index: tuple[int, ...] | None = None, width: int = 4) -> str:
    """A short text form of ``arr``: whole if small, else a window around ``index``
    (along the last axis) written ``[i:j]=[...]``."""
    a = np.asarray(arr)
    if a.ndim == 0:
        return _fmt(a[()])
    if index is None or len(index) != a.ndim:
        if a.size <= 2 * width + 2:
            return "[" + ", ".join(_fmt(v) for v in a.ravel()) + "]" + (
                f" shape {list(a.shape)}" if a.ndim > 1 else "")
        return (f"shape {list(a.shape)} [" + ", ".join(_fmt(v) for v in a.ravel()[:2 * width]) + ", …]")
    line = a[tuple(index[:-1])] if a.ndim > 1 else a
    i = int(index[-1])
    lo, hi = max(0, i - width), min(line.shape[0], i + width + 1)
    prefix = "" if a.ndim == 1 else "[" + ", ".join(str(int(v)) for v in index[:-1]) + "]"
    body = ", ".join(("*" if j == i else "") + _fmt(line[j]) for j in range(lo, hi))
    return f"{prefix}[{lo}:{hi}]=[{body}]"


def first_difference(expected: Any, actual: Any) -> tuple[bool, tuple[int, ...] | None, str]:
    """``(differs, first index, reason)`` comparing two arrays exactly (shape, then values)."""
    e, a = np.asarray(expected), np.asarray(actual)
    if e.shape != a.shape:
        return True, None, f"shape {list(a.shape)}, expected {list(e.shape)}"
    if (e.dtype.kind == "U") != (a.dtype.kind == "U"):
        return True, None, f"dtype {a.dtype}, expected {e.dtype}"
    if e.size == 0:
        return False, None, ""
    if e.dtype.names is not None or a.dtype.names is not None:
        neq = np.asarray([x != y for x, y in zip(e.ravel().tolist(), a.ravel().tolist())]).reshape(e.shape)
    elif e.dtype.kind in "fc" and a.dtype.kind in "fc":
        neq = ~((e == a) | (np.isnan(e) & np.isnan(a)))
    else:
        neq = e != a
    if not neq.any():
        return False, None, ""
    idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(neq)), neq.shape))
    return True, idx, "values differ"


# --------------------------------------------------------------------------- machinery

class _Skip(Exception):
    """An input view or phase was not recorded: the check does not run on this (step, rank)."""


class _Fail(Exception):
    def __init__(self, violation_kwargs: dict[str, Any]):
        super().__init__(violation_kwargs.get("message", ""))
        self.kw = violation_kwargs


@dataclass(frozen=True)
class _Config:
    pcp: int | None
    dcp: int
    dcp_rank: int
    dcp_interleave: int
    shard: bool | None
    k: int | None
    block_sizes: tuple[int, ...] | None
    speculative_method: str = "mtp"

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "_Config":
        def as_int(key, default=None):
            v = meta.get(key, default)
            try:
                return None if v is None else int(v)
            except (TypeError, ValueError):
                return default
        pcp = as_int("pcp")
        dcp = as_int("dcp", 1) or 1
        shard = meta.get("shard_decode_requests")
        sizes = meta.get("block_sizes")
        if isinstance(sizes, (list, tuple)) and sizes:
            block_sizes = tuple(int(b) for b in sizes)
        elif meta.get("block_size") is not None:
            block_sizes = (as_int("block_size"),)
        else:
            block_sizes = None
        return cls(pcp=pcp, dcp=dcp, dcp_rank=as_int("dcp_rank", 0) or 0,
                   dcp_interleave=as_int("dcp_interleave", 1) or 1,
                   shard=None if shard is None else bool(shard),
                   k=as_int("num_speculative_tokens"), block_sizes=block_sizes,
                   speculative_method=str(meta.get("speculative_method") or "mtp"))


def _is_warmup(phases: Mapping[str, Mapping[str, np.ndarray]]) -> bool:
    """A step vLLM ran while warming up (``target`` view ``warmup``; recorded only with
    ``PCPVIZ_RECORD_DUMMY=1``): synthetic requests with made-up draft tokens."""
    w = phases.get("target", {}).get("warmup")
    return w is not None and bool(np.asarray(w).any())


class _StepView:
    """One step's records on every rank (``recs[rank][phase]``) and the previous step's."""

    def __init__(self, step: int, recs: dict[int, dict[str, Mapping[str, np.ndarray]]],
                 prev: "_StepView | None", missing: tuple[int, ...]):
        self.step = step
        self.recs = recs
        self.prev = prev
        self.missing = missing  # ranks lacking this step although they recorded later steps
        self.cache: dict[Any, Any] = {}


class _Ctx:
    """What a check sees for one (step, rank)."""

    def __init__(self, cfg: _Config, sv: _StepView, rank: int, check: str):
        self.cfg, self.sv, self.rank, self.check = cfg, sv, rank, check
        self.phases = sv.recs[rank]

    @property
    def step(self) -> int:
        return self.sv.step

    # -- reading views
    def has(self, phase: str) -> bool:
        return phase in self.phases

    def get(self, phase: str, view: str) -> np.ndarray | None:
        rec = self.phases.get(phase)
        if rec is None or view not in rec:
            return None
        return rec[view]

    def need(self, phase: str, view: str) -> np.ndarray:
        rec = self.phases.get(phase)
        if rec is None:
            raise _Skip(f"no {phase} phase")
        if view not in rec:
            raise _Skip(f"no {view}")
        return rec[view]

    def t(self, view: str) -> np.ndarray:
        return self.need("target", view)

    def draft_phases(self, first: int = 0) -> list[tuple[int, str]]:
        out = [(draft_index(p), p) for p in self.phases if draft_index(p) is not None]
        return sorted((k, p) for k, p in out if k >= first)

    def prev(self) -> "_Ctx | None":
        pv = self.sv.prev
        if pv is None or self.rank not in pv.recs:
            return None
        if _is_warmup(pv.recs[self.rank]) or _is_warmup(self.phases):
            return None  # vLLM's synthetic warm-up steps do not continue into serving
        return _Ctx(self.cfg, pv, self.rank, self.check)

    # -- derived quantities (cached per step where they are rank-independent)
    def pcp(self) -> int:
        if self.cfg.pcp:
            return self.cfg.pcp
        prn = self.get("target", "per_rank_num_tokens")
        if prn is not None:
            return int(prn.shape[0])
        return max(self.sv.recs) + 1

    def shard(self) -> bool:
        if self.cfg.shard is not None:
            return self.cfg.shard
        return self.pcp() > 1 and self.cfg.dcp == 1

    def num_reqs(self) -> int:
        for view in ("num_scheduled_tokens", "req_ids", "seq_lens", "is_prefilling"):
            v = self.get("target", view)
            if v is not None:
                return int(v.shape[0])
        v = self.get("verify", "num_sampled")
        if v is not None:
            return int(v.shape[0])
        raise _Skip("no num_scheduled_tokens")

    def qsl(self) -> np.ndarray:
        """int64[R+1] from num_scheduled_tokens (or the recorded query_start_loc)."""
        q = self.get("target", "num_scheduled_tokens")
        if q is not None:
            out = np.zeros(q.shape[0] + 1, dtype=np.int64)
            np.cumsum(q, out=out[1:])
            return out
        return self.t("query_start_loc").astype(np.int64)

    def q(self) -> np.ndarray:
        q = self.get("target", "num_scheduled_tokens")
        return np.diff(self.qsl()) if q is None else q.astype(np.int64)

    def padded(self) -> int:
        """P, from the recorded padded_gather_idx (or the local views)."""
        pgi = self.get("target", "padded_gather_idx")
        if pgi is not None:
            n = self.pcp()
            if pgi.shape[0] % n:
                self.fail("target", "padded_gather_idx",
                          f"length {pgi.shape[0]} is not a multiple of pcp={n}")
            return pgi.shape[0] // n
        for view in ("local_positions", "local_input_ids", "local_is_padding"):
            v = self.get("target", view)
            if v is not None:
                return int(v.shape[0])
        raise _Skip("no padded_gather_idx")

    def num_local(self) -> int:
        prn = self.get("target", "per_rank_num_tokens")
        if prn is not None:
            if self.rank >= prn.shape[0]:
                self.fail("target", "per_rank_num_tokens",
                          f"has {prn.shape[0]} entries, no entry for rank {self.rank}")
            return int(prn[self.rank])
        pad = self.get("target", "local_is_padding")
        if pad is not None:
            return int((~pad.astype(bool)).sum())
        raise _Skip("no per_rank_num_tokens")

    def rank_rows(self) -> np.ndarray:
        """int64[n]: global token of each real local row of this rank."""
        pgi = self.t("padded_gather_idx")
        p, n = self.padded(), self.num_local()
        return pgi[self.rank * p:self.rank * p + n].astype(np.int64)

    def block_sizes(self, groups: int) -> list[int]:
        bs = self.cfg.block_sizes
        if bs is None:
            raise _Skip("no block_size in run.json")
        if len(bs) == 1:
            return list(bs) * groups
        if len(bs) != groups:
            raise _Skip(f"run.json has {len(bs)} block sizes for {groups} KV-cache groups")
        return list(bs)

    def slots(self, table: np.ndarray, qsl: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """int64[G, T]: slots of rows ``arange(R)`` of a global-order table [G, R, W] (DCP
        settings from run.json). Block indices past the table's width read the null block 0,
        as a zero-padded vLLM table would; ``no_null_block`` then reports them."""
        sizes = self.block_sizes(table.shape[0])
        kw = {}
        if self.cfg.dcp > 1:
            kw = dict(cp_size=self.cfg.dcp, cp_rank=self.cfg.dcp_rank,
                      cp_interleave=self.cfg.dcp_interleave)
        rows = np.arange(table.shape[1], dtype=np.int64)
        out = []
        for g in range(table.shape[0]):
            tg = table[g]
            if positions.size:
                width = int(positions.max()) // (sizes[g] * self.cfg.dcp) + 1
                if width > tg.shape[1]:
                    tg = np.concatenate([tg, np.zeros((tg.shape[0], width - tg.shape[1]), tg.dtype)], axis=1)
            out.append(compute_slot_mappings(tg, sizes[g], rows, qsl, positions, **kw)[0])
        return np.stack(out) if out else np.zeros((0, int(qsl[-1])), dtype=np.int64)

    def no_null_block(self, phase: str, view: str, expected: np.ndarray, actual: np.ndarray,
                      positions: np.ndarray) -> None:
        """Fail if a KV write lands in the null block 0 (never allocated to a request)."""
        sizes = self.block_sizes(expected.shape[0])
        for g in range(expected.shape[0]):
            null = (expected[g] >= 0) & (expected[g] // sizes[g] == 0)
            if null.any():
                j = int(np.argmax(null))
                self.fail(phase, view, f"token {j} (position {int(positions[j])}) writes into the null "
                          "block 0: its request has no KV block for that position",
                          index=(g, j), expected="a slot in an allocated block",
                          actual=short_repr(actual, (g, j)))

    # -- verdicts
    def fail(self, phase: str | None, view: str | None, message: str, *, index=None,
             expected=None, actual=None, rank: int | None = None) -> None:
        raise _Fail(dict(check=self.check, step=self.step, rank=self.rank if rank is None else rank,
                         phase=phase, view=view, message=message,
                         index=None if index is None else tuple(int(i) for i in index),
                         expected=expected, actual=actual))

    def expect(self, phase: str, view: str, expected: Any, actual: Any, what: str = "",
               *, index_map: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
               rank: int | None = None) -> None:
        """Fail unless ``actual`` equals ``expected`` exactly. ``index_map`` translates an index
        into the compared arrays to one into the recorded view (for masked comparisons)."""
        differs, idx, reason = first_difference(expected, actual)
        if not differs:
            return
        if idx is None:
            self.fail(phase, view, f"{what + ': ' if what else ''}{reason}",
                      expected=short_repr(expected), actual=short_repr(actual), rank=rank)
        shown = index_map(idx) if index_map is not None else idx
        self.fail(phase, view, what or "values differ", index=shown,
                  expected=short_repr(expected, idx), actual=short_repr(actual, idx), rank=rank)


def _g3(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a[None] if a.ndim == 2 else a


def _g2(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a[None] if a.ndim == 1 else a


def _str0(a: np.ndarray) -> str:
    a = np.asarray(a)
    return str(a.reshape(-1)[0]) if a.size else ""


def _token_rows(qsl: np.ndarray) -> np.ndarray:
    """int64[T]: request row of every global token."""
    return np.repeat(np.arange(qsl.shape[0] - 1, dtype=np.int64), np.diff(qsl))


def _segments(ctx: _Ctx) -> np.ndarray:
    segs = ctx.t("segments")
    if segs.dtype.names is None or not set(SEGMENT_DTYPE.names) <= set(segs.dtype.names):
        ctx.fail("target", "segments", f"not a segments table (fields {segs.dtype.names}, "
                 f"expected {SEGMENT_DTYPE.names})")
    return segs


def _segment_rows(segs: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(gathered row, segment index) of every row covered by the segments table."""
    lens = (segs["local_stop"] - segs["local_start"]).astype(np.int64)
    seg_of = np.repeat(np.arange(segs.shape[0]), lens)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    offset = np.arange(seg_of.shape[0]) - starts
    rows = segs["rank"][seg_of] * p + segs["local_start"][seg_of] + offset
    return rows.astype(np.int64), seg_of


def _rank_segments(ctx: _Ctx) -> tuple[np.ndarray, np.ndarray]:
    """(global request, length) of this rank's local segments, in local order; a rank without
    segments has vLLM's zero-length placeholder row for request 0."""
    segs = _segments(ctx)
    mine = segs[segs["rank"] == ctx.rank]
    mine = mine[np.argsort(mine["local_start"], kind="stable")]
    if mine.shape[0] == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    return mine["global_req_idx"].astype(np.int64), (mine["local_stop"] - mine["local_start"]).astype(np.int64)


# --------------------------------------------------------------------------- the checks

@dataclass(frozen=True)
class _CheckDef:
    name: str
    description: str
    fn: Callable[[_Ctx], None]


_DEFS: list[_CheckDef] = []


def _check(name: str, description: str):
    def deco(fn):
        _DEFS.append(_CheckDef(name, description, fn))
        return fn
    return deco


@_check("layout_matches_plan",
        "recorded segments, per_rank_num_tokens, padded_gather_idx, hidden_restore_idx and "
        "kv_write_mask equal plan_layout(num_scheduled_tokens, is_prefilling, pcp, ...) with the "
        "recorded P")
def layout_matches_plan(c: _Ctx) -> None:
    q, pf = c.t("num_scheduled_tokens"), c.t("is_prefilling")
    c.t("padded_gather_idx")
    p = c.padded()
    key = ("plan", p, q.tobytes(), pf.tobytes())
    plan = c.sv.cache.get(key)
    if plan is None:
        try:
            plan = plan_layout(q.astype(np.int64), pf.astype(bool), c.pcp(),
                               shard_decode_requests=c.shard(), dcp_world_size=c.cfg.dcp,
                               padded_num_tokens=p)
        except ValueError as exc:
            plan = exc
        c.sv.cache[key] = plan
    if isinstance(plan, ValueError):
        c.fail("target", "padded_gather_idx", f"plan_layout rejects this batch: {plan}")
    expected = {
        "segments": segments_table(plan.segments_by_rank),
        "per_rank_num_tokens": np.asarray(plan.per_rank_num_tokens, dtype=np.int64),
        "padded_gather_idx": plan.padded_gather_idx,
        "hidden_restore_idx": plan.hidden_restore_idx,
        "kv_write_mask": plan.kv_write_mask,
    }
    for view, exp in expected.items():
        act = c.get("target", view)
        if act is None:
            continue
        if view == "segments":
            _segments(c)
            exp = np.stack([exp[f] for f in SEGMENT_DTYPE.names], axis=1) if exp.size else \
                np.zeros((0, len(SEGMENT_DTYPE.names)), dtype=np.int64)
            act = np.stack([act[f].astype(np.int64) for f in SEGMENT_DTYPE.names], axis=1) if act.size \
                else np.zeros((0, len(SEGMENT_DTYPE.names)), dtype=np.int64)
            c.expect("target", view, exp, act, "segment rows (global_req_idx, global_start, "
                     "global_stop, local_start, local_stop, rank) differ from the plan")
        else:
            c.expect("target", view, exp, np.asarray(act).astype(exp.dtype, copy=False),
                     f"{view} differs from plan_layout")


@_check("restore_gather_identity",
        "padded_gather_idx[hidden_restore_idx] == arange(T): restoring the all-gathered rows "
        "gives back the global token order")
def restore_gather_identity(c: _Ctx) -> None:
    pgi, hri = c.t("padded_gather_idx"), c.t("hidden_restore_idx")
    t = int(c.qsl()[-1])
    if hri.shape != (t,):
        c.fail("target", "hidden_restore_idx", f"length {hri.shape[0] if hri.ndim else 0}, expected T={t}")
    bad = (hri < 0) | (hri >= pgi.shape[0])
    if bad.any():
        i = int(np.argmax(bad))
        c.fail("target", "hidden_restore_idx", f"row {int(hri[i])} is outside the "
               f"{pgi.shape[0]} gathered rows", index=(i,), actual=short_repr(hri, (i,)))
    c.expect("target", "hidden_restore_idx", np.arange(t), pgi[hri],
             "padded_gather_idx[hidden_restore_idx] is not the identity")


@_check("kv_written_once",
        "kv_write_mask covers only real rows and exactly T of them; the non-PAD slots of "
        "slot_mapping_gathered are unique and a permutation of slot_mapping_global's: each slot "
        "is written exactly once per KV replica")
def kv_written_once(c: _Ctx) -> None:
    mask = c.t("kv_write_mask").astype(bool)
    p = c.padded()
    n = c.pcp()
    prn = c.t("per_rank_num_tokens")
    t = int(c.qsl()[-1])
    if mask.shape != (n * p,):
        c.fail("target", "kv_write_mask", f"length {mask.shape}, expected N*P={n * p}")
    real = (np.arange(p)[None, :] < np.asarray(prn)[:, None]).ravel()
    if real.shape == mask.shape and (mask & ~real).any():
        j = int(np.argmax(mask & ~real))
        c.fail("target", "kv_write_mask", f"gathered row {j} (rank {j // p}, local row {j % p}) is "
               "padding but marked for a KV write", index=(j,), expected="F", actual="T")
    if int(mask.sum()) != t:
        c.fail("target", "kv_write_mask", f"{int(mask.sum())} rows marked for a KV write, expected "
               f"T={t} (one per global token)", expected=str(t), actual=str(int(mask.sum())))
    glob = c.get("target", "slot_mapping_global")
    gath = c.get("target", "slot_mapping_gathered")
    if gath is None:
        return
    gath = _g2(gath)
    for g in range(gath.shape[0]):
        row = gath[g]
        written = row[row != PAD_SLOT_ID]
        srt = np.sort(written, kind="stable")
        dup = np.flatnonzero(srt[1:] == srt[:-1])
        if dup.size:
            slot = int(srt[dup[0]])
            where = np.flatnonzero(row == slot)
            c.fail("target", "slot_mapping_gathered", f"slot {slot} is written {where.size} times "
                   f"(gathered rows {where[:4].tolist()})", index=(g, int(where[1])),
                   expected="each slot once", actual=short_repr(gath, (g, int(where[1]))))
        if glob is None:
            continue
        gl = _g2(glob)[g]
        gw = np.sort(gl[gl != PAD_SLOT_ID], kind="stable")
        if gw.shape != srt.shape or not np.array_equal(gw, srt):
            extra = np.setdiff1d(srt, gw)
            missing = np.setdiff1d(gw, srt)
            if extra.size:
                j = int(np.flatnonzero(row == extra[0])[0])
                c.fail("target", "slot_mapping_gathered", f"slot {int(extra[0])} is written but is "
                       "not in slot_mapping_global", index=(g, j), actual=short_repr(gath, (g, j)))
            slot = int(missing[0]) if missing.size else None
            c.fail("target", "slot_mapping_gathered",
                   f"{gw.size} global slots but {srt.size} written" if slot is None else
                   f"global slot {slot} (token {int(np.flatnonzero(gl == slot)[0])}) is never written",
                   expected=f"{gw.size} slots", actual=f"{srt.size} slots")


@_check("gathered_slots_are_global",
        "slot_mapping_gathered[:, j] == slot_mapping_global[:, padded_gather_idx[j]] where "
        "kv_write_mask[j], PAD elsewhere")
def gathered_slots_are_global(c: _Ctx) -> None:
    glob, gath = _g2(c.t("slot_mapping_global")), _g2(c.t("slot_mapping_gathered"))
    pgi, mask = c.t("padded_gather_idx"), c.t("kv_write_mask").astype(bool)
    if glob.shape[1] == 0:
        picked = np.zeros((glob.shape[0], pgi.shape[0]), dtype=np.int64)
    else:
        if pgi.size and (pgi.min() < 0 or pgi.max() >= glob.shape[1]):
            c.fail("target", "padded_gather_idx", f"indexes outside the {glob.shape[1]} global tokens")
        picked = glob[:, pgi]
    expected = np.where(mask[None, :], picked, PAD_SLOT_ID)
    c.expect("target", "slot_mapping_gathered", expected, gath,
             "gathered slot differs from the global slot of its token (PAD where not written)")


@_check("global_slots_match_block_table",
        "slot_mapping_global == the slots of block_table_global's rows at the global positions "
        "(block_size from run.json), none in the null block 0")
def global_slots_match_block_table(c: _Ctx) -> None:
    glob = _g2(c.t("slot_mapping_global"))
    table = _g3(c.t("block_table_global"))
    pos = c.t("positions").astype(np.int64)
    qsl = c.qsl()
    if table.shape[1] != qsl.shape[0] - 1:
        c.fail("target", "block_table_global", f"{table.shape[1]} rows for {qsl.shape[0] - 1} requests")
    expected = c.slots(table, qsl, pos)
    c.expect("target", "slot_mapping_global", expected, glob,
             "slot differs from block_table_global[row, position // block_size]")
    c.no_null_block("target", "slot_mapping_global", expected, glob, pos)


@_check("kv_write_mask_canonical",
        "the gathered slot mapping's write mask: DualChunkSwap prefill rows are kept where they are "
        "computed; a sharded decode has one owner rank, whose row is kept; of a replicated "
        "(non-sharded) row only rank 0's copy is kept (for replicated decodes every rank still writes "
        "its own local rows with rank 0's slots; the mask drops duplicate gathered prefill rows and "
        "picks the copy hidden_restore_idx reads)")
def kv_write_mask_canonical(c: _Ctx) -> None:
    segs = _segments(c)
    mask = c.t("kv_write_mask").astype(bool)
    q, pf = c.q(), c.t("is_prefilling").astype(bool)
    p, n = c.padded(), c.pcp()
    rows, seg_of = _segment_rows(segs, p)
    if rows.size and (rows.max() >= mask.shape[0] or rows.min() < 0):
        c.fail("target", "segments", "segments reach outside the gathered rows")
    req = segs["global_req_idx"][seg_of].astype(np.int64)
    rank = segs["rank"][seg_of].astype(np.int64)
    replicated = replicated_requests(q, pf, n, c.cfg.dcp)
    shard = c.shard()
    sharded_decode = shard & ~pf
    canonical_only = replicated[req] & ~sharded_decode[req]
    expected = ~(canonical_only & (rank != 0))
    actual = mask[rows]
    bad = expected != actual
    if bad.any():
        i = int(np.argmax(bad))
        j, r = int(rows[i]), int(req[i])
        kind = ("replicated row: only rank 0's copy is kept" if canonical_only[i]
                else "sharded decode: its owner writes it" if replicated[r] else "prefill chunk row")
        c.fail("target", "kv_write_mask", f"gathered row {j} (rank {int(rank[i])}, request row {r}): "
               f"{kind}", index=(j,), expected=_fmt(expected[i]), actual=_fmt(actual[i]))
    if shard:
        dec = segs[~pf[segs["global_req_idx"]]]
        reqs, counts = np.unique(dec["global_req_idx"], return_counts=True)
        if (counts > 1).any():
            r = int(reqs[np.argmax(counts > 1)])
            owners = dec["rank"][dec["global_req_idx"] == r].tolist()
            c.fail("target", "segments", f"sharded decode (request row {r}) is placed on ranks "
                   f"{owners}; it must have one owner", expected="1 owner", actual=str(owners))


@_check("local_batch_matches_layout",
        "the rank-local batch follows its segments: local_req_ids, local_query_start_loc, "
        "local_input_ids == input_ids[padded_gather_idx], local_is_padding, local_logits_indices "
        "== local_query_start_loc[1:] - 1, block_table_local == the segments' global rows")
def local_batch_matches_layout(c: _Ctx) -> None:
    seg_req, seg_len = _rank_segments(c)
    n, p = c.num_local(), c.padded()
    checked = False
    ids = c.get("target", "local_req_ids")
    gids = c.get("target", "req_ids")
    if ids is not None and gids is not None:
        checked = True
        c.expect("target", "local_req_ids", gids[seg_req] if gids.size else seg_req.astype(str), ids,
                 "local request ids differ from the segments' requests")
    lqsl = c.get("target", "local_query_start_loc")
    if lqsl is not None:
        checked = True
        exp = np.zeros(seg_len.shape[0] + 1, dtype=np.int64)
        np.cumsum(seg_len, out=exp[1:])
        act = lqsl.astype(np.int64)
        if act.shape[0] > exp.shape[0]:  # padded request rows repeat the token count
            exp = np.concatenate([exp, np.full(act.shape[0] - exp.shape[0], exp[-1])])
        c.expect("target", "local_query_start_loc", exp, act, "local segment starts differ")
        lli = c.get("target", "local_logits_indices")
        if lli is not None:
            c.expect("target", "local_logits_indices", (act[1:] - 1)[:lli.shape[0]], lli.astype(np.int64),
                     "local_logits_indices != local_query_start_loc[1:] - 1")
    lin, gin = c.get("target", "local_input_ids"), c.get("target", "input_ids")
    if lin is not None and gin is not None and c.get("target", "padded_gather_idx") is not None:
        checked = True
        if lin.shape != (p,):
            c.fail("target", "local_input_ids", f"length {lin.shape}, expected P={p}")
        c.expect("target", "local_input_ids", gin[c.rank_rows()].astype(np.int64),
                 lin[:n].astype(np.int64), "local input id differs from the global token it holds")
    pad = c.get("target", "local_is_padding")
    if pad is not None:
        checked = True
        c.expect("target", "local_is_padding", np.arange(p) >= n, pad.astype(bool),
                 f"the first {n} rows are real, the rest padding")
    btl, btg = c.get("target", "block_table_local"), c.get("target", "block_table_global")
    if btl is not None and btg is not None:
        checked = True
        btl, btg = _g3(btl), _g3(btg)
        exp = btg[:, seg_req]
        if btl.shape[1] > exp.shape[1]:
            exp = np.concatenate([exp, np.zeros((exp.shape[0], btl.shape[1] - exp.shape[1], exp.shape[2]),
                                                exp.dtype)], axis=1)
        c.expect("target", "block_table_local", exp, btl,
                 "local block-table row differs from its request's global row")
    if not checked:
        raise _Skip("no local_req_ids")


@_check("local_positions_are_global",
        "local_positions[real rows] == positions[padded_gather_idx[rank rows]]: positions come "
        "from the global batch (the GPU cursor), not the CPU cursor")
def local_positions_are_global(c: _Ctx) -> None:
    lpos, pos = c.t("local_positions"), c.t("positions")
    p, n = c.padded(), c.num_local()
    if lpos.shape != (p,):
        c.fail("target", "local_positions", f"length {lpos.shape}, expected P={p}")
    c.expect("target", "local_positions", pos[c.rank_rows()].astype(np.int64), lpos[:n].astype(np.int64),
             "local position differs from the global position of its token")


@_check("local_seq_lens",
        "local_seq_lens[i] == local_positions[last row of segment i] + 1 (0 for empty rows)")
def local_seq_lens(c: _Ctx) -> None:
    lsl, lqsl, lpos = c.t("local_seq_lens"), c.t("local_query_start_loc"), c.t("local_positions")
    r = lsl.shape[0]
    if lqsl.shape[0] < r + 1:
        c.fail("target", "local_query_start_loc", f"{lqsl.shape[0]} entries for {r} local rows")
    ends = lqsl[1:r + 1].astype(np.int64)
    lens = ends - lqsl[:r].astype(np.int64)
    if ends.size and (ends.max() > lpos.shape[0]):
        c.fail("target", "local_query_start_loc", f"ends past the {lpos.shape[0]} local rows")
    exp = np.where(lens > 0, lpos[np.maximum(ends - 1, 0)].astype(np.int64) + 1, 0) if r else \
        np.zeros(0, dtype=np.int64)
    c.expect("target", "local_seq_lens", exp, lsl.astype(np.int64),
             "local seq_len != last local position + 1")


@_check("local_logits_not_sampled",
        "sampling used the global rows: sampled_logits_rows == logits_indices and sampled_from "
        "== 'global' (local logits are never sampled)")
def local_logits_not_sampled(c: _Ctx) -> None:
    rows = c.t("sampled_logits_rows")
    li = c.t("logits_indices")
    c.expect("target", "sampled_logits_rows", li.astype(np.int64), rows.astype(np.int64),
             "sampled rows are not the global logits_indices (local logits sampled?)")
    src = c.get("target", "sampled_from")
    if src is not None and _str0(src) != "global":
        c.fail("target", "sampled_from", "sampling must read the restored global hidden states",
               expected="'global'", actual=repr(_str0(src)))


@_check("draft_prefill_rank_local",
        "draft_0 is rank_local: it reuses the target's local rows (draft_positions == "
        "local_positions, draft_seq_lens == local_seq_lens, block_table_draft == "
        "block_table_local) and the target's gathered slot mapping ([G, N*P])")
def draft_prefill_rank_local(c: _Ctx) -> None:
    if not c.has("draft_0"):
        raise _Skip("no draft_0 phase")
    if c.cfg.speculative_method == "dspark":
        # DSpark drafts replicated from its first step (its drafter is built with PCP=1).
        raise _Skip("DSpark has no rank-local draft prefill")
    view = c.get("draft_0", "view")
    checked = False
    if view is not None and c.pcp() > 1:
        checked = True
        if _str0(view) != "rank_local":
            c.fail("draft_0", "view", "the MTP draft prefill runs on the rank-local rows",
                   expected="'rank_local'", actual=repr(_str0(view)))
    pairs = [("slot_mapping_draft", "slot_mapping_gathered", _g2),
             ("draft_positions", "local_positions", np.asarray),
             ("draft_seq_lens", "local_seq_lens", np.asarray),
             ("block_table_draft", "block_table_local", _g3)]
    for dview, tview, norm in pairs:
        d, t = c.get("draft_0", dview), c.get("target", tview)
        if d is None or t is None:
            continue
        checked = True
        d, t = norm(d), norm(t)
        if dview == "slot_mapping_draft" and d.shape[-1] != t.shape[-1]:
            c.fail("draft_0", dview, f"length {d.shape[-1]}, expected the expanded N*P="
                   f"{t.shape[-1]} (the target's gathered mapping)")
        c.expect("draft_0", dview, t, d, f"{dview} != the target's {tview}")
    if not checked:
        raise _Skip("no slot_mapping_draft")


@_check("draft_last_token_indices",
        "draft_0's draft_last_token_indices[i] == query_start_loc[i] + q[i] - num_rejected[i] - 1 "
        "(global rows; the last accepted token of each request)")
def draft_last_token_indices(c: _Ctx) -> None:
    lti = c.need("draft_0", "draft_last_token_indices")
    rej = c.need("verify", "num_rejected").astype(np.int64)
    qsl, q = c.qsl(), c.q()
    if lti.shape != q.shape or rej.shape != q.shape:
        c.fail("draft_0", "draft_last_token_indices", f"length {lti.shape}, expected R={q.shape[0]}")
    has = np.flatnonzero(q > 0)
    c.expect("draft_0", "draft_last_token_indices", (qsl[:-1] + q - rej - 1)[has],
             lti.astype(np.int64)[has], "not the last accepted row of its request",
             index_map=lambda i: (int(has[i[0]]),))


@_check("draft_input_ids",
        "draft_0's draft_global_input_ids are the target ids shifted left by one within the "
        "accepted rows, the last accepted row holding the sampled token; its local "
        "draft_input_ids are their gather; draft_k (k >= 1) inputs are draft_{k-1}'s tokens")
def draft_input_ids(c: _Ctx) -> None:
    drafts = c.draft_phases()
    if not drafts:
        raise _Skip("no draft_0 phase")
    checked = False
    dgi = c.get("draft_0", "draft_global_input_ids")
    if dgi is not None:
        ids = c.t("input_ids").astype(np.int64)
        qsl, q = c.qsl(), c.q()
        rej = c.need("verify", "num_rejected").astype(np.int64)
        ns = c.need("verify", "num_sampled").astype(np.int64)
        sampled = _g2(c.need("verify", "sampled_token_ids")).astype(np.int64)
        if dgi.shape != ids.shape:
            c.fail("draft_0", "draft_global_input_ids", f"length {dgi.shape}, expected T={ids.shape[0]}")
        checked = True
        t = ids.shape[0]
        row = _token_rows(qsl)
        off = np.arange(t) - qsl[row]
        valid = (q - rej)[row]
        shifted = off < valid - 1
        exp = np.full(t, -1, dtype=np.int64)
        exp[:-1][shifted[:-1]] = ids[1:][shifted[:-1]]
        last = (off == valid - 1) & (ns[row] > 0)
        if last.any():
            rl = row[last]
            exp[last] = sampled[rl, ns[rl] - 1]
        m = np.flatnonzero(shifted | last)
        c.expect("draft_0", "draft_global_input_ids", exp[m], dgi.astype(np.int64)[m],
                 "draft prefill input is not the next target token (or the sampled one)",
                 index_map=lambda i: (int(m[i[0]]),))
        dii = c.get("draft_0", "draft_input_ids")
        if dii is not None and c.get("target", "padded_gather_idx") is not None:
            n = c.num_local()
            c.expect("draft_0", "draft_input_ids", dgi[c.rank_rows()].astype(np.int64),
                     dii[:n].astype(np.int64), "local draft input != draft_global_input_ids of its token")
    prev_tokens = None
    for k, phase in drafts:
        if k >= 1 and prev_tokens is not None:
            dii = c.get(phase, "draft_input_ids")
            if dii is not None:
                checked = True
                c.expect(phase, "draft_input_ids", prev_tokens.astype(np.int64), dii.astype(np.int64),
                         f"draft_{k} input != draft_{k - 1}'s tokens")
        prev_tokens = c.get(phase, "draft_tokens")
    if not checked:
        raise _Skip("no draft_global_input_ids")


@_check("draft_decode_replicated",
        "draft_k (k >= 1) is replicated on the global rows: view 'replicated', slot_mapping_draft "
        "unexpanded ([G, R]) and equal to the slots of block_table_global's rows at draft_positions, "
        "none in the null block 0")
def draft_decode_replicated(c: _Ctx) -> None:
    phases = c.draft_phases(1)
    if not phases:
        raise _Skip("no draft_1 phase")
    r = c.num_reqs()
    for k, phase in phases:
        view = c.get(phase, "view")
        if view is not None and _str0(view) != "replicated":
            c.fail(phase, "view", "draft decodes run replicated on the global batch",
                   expected="'replicated'", actual=repr(_str0(view)))
        for v in ("draft_input_ids", "draft_positions", "draft_seq_lens", "draft_tokens"):
            a = c.get(phase, v)
            if a is not None and a.shape != (r,):
                c.fail(phase, v, f"shape {list(a.shape)}, expected one row per request [{r}]")
        smd = c.get(phase, "slot_mapping_draft")
        if smd is None:
            raise _Skip("no slot_mapping_draft")
        smd = _g2(smd)
        if smd.shape[-1] != r:
            c.fail(phase, "slot_mapping_draft", f"length {smd.shape[-1]}, expected R={r}: draft decode "
                   "slot mappings are unexpanded (the attention layer writes locally)",
                   expected=f"[G, {r}]", actual=str(list(smd.shape)))
        pos, table = c.get(phase, "draft_positions"), c.get("target", "block_table_global")
        if pos is None or table is None or c.cfg.block_sizes is None:
            continue
        pos = pos.astype(np.int64)
        exp = c.slots(_g3(table), np.arange(r + 1, dtype=np.int64), pos)
        c.expect(phase, "slot_mapping_draft", exp, smd,
                 "slot differs from the global row's block at draft_positions")
        c.no_null_block(phase, "slot_mapping_draft", exp, smd, pos)


@_check("draft_block_tables_global",
        "draft_k (k >= 1) block_table_draft == block_table_global (the block tables were gathered "
        "back to global order before the replicated decodes)")
def draft_block_tables_global(c: _Ctx) -> None:
    phases = c.draft_phases(1)
    if not phases:
        raise _Skip("no draft_1 phase")
    btg = _g3(c.t("block_table_global"))
    checked = False
    for k, phase in phases:
        btd = c.get(phase, "block_table_draft")
        if btd is None:
            continue
        checked = True
        c.expect(phase, "block_table_draft", btg, _g3(btd),
                 "draft decode block-table row != the request's global row (gather skipped?)")
    if not checked:
        raise _Skip("no block_table_draft")


@_check("draft_positions_advance",
        "draft_1 positions == positions[draft_last_token_indices] + 1, draft_k == draft_{k-1} + 1, "
        "and draft_seq_lens == draft_positions + 1 (k >= 1)")
def draft_positions_advance(c: _Ctx) -> None:
    phases = c.draft_phases(1)
    if not phases:
        raise _Skip("no draft_1 phase")
    q = c.q()
    has = np.flatnonzero(q > 0)
    imap = lambda i: (int(has[i[0]]),)  # noqa: E731
    prev = None
    if phases[0][0] == 1:
        lti = c.need("draft_0", "draft_last_token_indices").astype(np.int64)
        pos = c.t("positions").astype(np.int64)
        if has.size and (lti[has].min() < 0 or lti[has].max() >= pos.shape[0]):
            c.fail("draft_0", "draft_last_token_indices", "indexes outside the global tokens")
        prev = np.zeros(q.shape[0], dtype=np.int64)
        prev[has] = pos[lti[has]]
    for k, phase in phases:
        dp = c.need(phase, "draft_positions").astype(np.int64)
        if dp.shape != q.shape:
            c.fail(phase, "draft_positions", f"shape {list(dp.shape)}, expected [{q.shape[0]}]")
        if prev is not None:
            what = ("!= positions[draft_last_token_indices] + 1" if k == 1
                    else f"!= draft_{k - 1} positions + 1")
            c.expect(phase, "draft_positions", (prev + 1)[has], dp[has], what, index_map=imap)
        dsl = c.get(phase, "draft_seq_lens")
        if dsl is not None:
            c.expect(phase, "draft_seq_lens", (dp + 1)[has], dsl.astype(np.int64)[has],
                     "draft seq_len != draft position + 1", index_map=imap)
        prev = dp


@_check("verify_consistent",
        "verify is self-consistent and matches the batch: num_sampled == the non -1 prefix of "
        "sampled_token_ids, num_sampled in {0, num_accepted + 1}, num_accepted + num_rejected == "
        "num_draft_tokens, accepted tokens == the scheduled drafts, logits_indices == each "
        "request's last 1 + num_draft_tokens rows")
def verify_consistent(c: _Ctx) -> None:
    ns = c.need("verify", "num_sampled").astype(np.int64)
    nacc = c.need("verify", "num_accepted").astype(np.int64)
    nrej = c.need("verify", "num_rejected").astype(np.int64)
    sampled = _g2(c.need("verify", "sampled_token_ids")).astype(np.int64)
    nd = c.get("verify", "num_draft_tokens")
    r = ns.shape[0]
    for v, a in (("num_accepted", nacc), ("num_rejected", nrej), ("sampled_token_ids", sampled)):
        if a.shape[0] != r:
            c.fail("verify", v, f"{a.shape[0]} rows, num_sampled has {r}")
    vid, tid = c.get("verify", "req_ids"), c.get("target", "req_ids")
    if vid is not None and tid is not None:
        c.expect("verify", "req_ids", tid, vid, "verify rows are not the target's global rows")
    width = sampled.shape[1]
    valid = sampled != -1
    c.expect("verify", "sampled_token_ids", np.arange(width)[None, :] < ns[:, None], valid,
             "sampled tokens must be the first num_sampled entries (-1 after)")
    bad = (ns != 0) & (ns != nacc + 1)
    if bad.any():
        i = int(np.argmax(bad))
        c.fail("verify", "num_sampled", f"request row {i}: num_sampled must be 0 or num_accepted + 1 "
               f"(num_accepted {int(nacc[i])})", index=(i,), expected=str(int(nacc[i]) + 1),
               actual=str(int(ns[i])))
    nd = (nacc + nrej) if nd is None else nd.astype(np.int64)
    c.expect("verify", "num_accepted", nd - nrej, nacc, "num_accepted + num_rejected != num_draft_tokens")
    if (nacc < 0).any() or (nrej < 0).any():
        i = int(np.argmax((nacc < 0) | (nrej < 0)))
        c.fail("verify", "num_accepted", "negative count", index=(i,))
    ids = c.get("target", "input_ids")
    if ids is None or c.get("target", "num_scheduled_tokens") is None:
        return
    qsl, q = c.qsl(), c.q()
    if q.shape[0] != r:
        c.fail("verify", "num_sampled", f"{r} rows, the target batch has {q.shape[0]} requests")
    if (nd > np.maximum(q - 1, 0)).any():
        i = int(np.argmax(nd > np.maximum(q - 1, 0)))
        c.fail("verify", "num_draft_tokens", f"request row {i} verifies {int(nd[i])} drafts but "
               f"was scheduled {int(q[i])} tokens", index=(i,))
    k = np.arange(width)[None, :]
    accepted = k < nacc[:, None]
    if accepted.any():
        src = np.clip((qsl[1:] - nd)[:, None] + k, 0, max(ids.shape[0] - 1, 0))
        exp = np.where(accepted, ids.astype(np.int64)[src], sampled)
        c.expect("verify", "sampled_token_ids", exp, sampled,
                 "an accepted token differs from the draft the target was scheduled with")
    li = c.get("target", "logits_indices")
    if li is not None and (q > 0).all():
        cnt = nd + 1
        starts = np.repeat(qsl[1:] - cnt, cnt)
        within = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        c.expect("target", "logits_indices", starts + within, li.astype(np.int64),
                 "logits rows are not each request's last 1 + num_draft_tokens rows")


@_check("drafts_fed_back",
        "a request continuing from the previous step is fed what that step produced: its first "
        "input id is the last sampled token and its scheduled drafts are the previous draft_k tokens")
def drafts_fed_back(c: _Ctx) -> None:
    pv = c.prev()
    if pv is None:
        raise _Skip("no previous step")
    ids = c.t("input_ids").astype(np.int64)
    rid = c.t("req_ids")
    qsl = c.qsl()
    nd = c.get("verify", "num_draft_tokens")
    prid = pv.t("req_ids")
    pns = pv.need("verify", "num_sampled").astype(np.int64)
    psampled = _g2(pv.need("verify", "sampled_token_ids")).astype(np.int64)
    pdrafts = [pv.get(p, "draft_tokens") for _, p in pv.draft_phases()]
    prow = {str(x): i for i, x in enumerate(prid.tolist())}
    cur = np.array([prow.get(str(x), -1) for x in rid.tolist()], dtype=np.int64)
    q = np.diff(qsl)
    ok = (cur >= 0) & (q > 0)
    rows = np.flatnonzero(ok)
    rows = rows[pns[cur[rows]] > 0]
    if rows.size == 0:
        return
    pr = cur[rows]
    ndr = np.zeros(rows.size, dtype=np.int64) if nd is None else nd.astype(np.int64)[rows]
    first = qsl[:-1][rows] + (q[rows] - 1 - ndr)  # the row before the drafts
    c.expect("target", "input_ids", psampled[pr, pns[pr] - 1], ids[first],
             "first input is not the token sampled for this request in the previous step",
             index_map=lambda i: (int(first[i[0]]),))
    if nd is None or not (ndr > 0).any():
        return
    width = int(ndr.max())
    if len(pdrafts) < width or any(d is None for d in pdrafts[:width]):
        return
    pd = np.stack([np.asarray(d, dtype=np.int64) for d in pdrafts[:width]], axis=1)[pr]  # [n, width]
    j = np.arange(width)[None, :]
    use = j < ndr[:, None]
    src = np.clip(first[:, None] + 1 + j, 0, ids.shape[0] - 1)
    exp = np.where(use, pd, 0)
    act = np.where(use, ids[src], 0)
    differs, idx, _ = first_difference(exp, act)
    if differs:
        i, jj = idx
        tok = int(src[i, jj])
        c.fail("target", "input_ids", f"scheduled draft {jj} of request {rid[rows[i]]!s} is not "
               f"draft_{jj}'s token from step {pv.step}", index=(tok,),
               expected=_fmt(exp[i, jj]), actual=short_repr(ids, (tok,)))


_AGREE = {
    "target": frozenset({"req_ids", "idx_mapping", "num_scheduled_tokens", "num_computed_tokens",
                         "query_start_loc", "positions", "input_ids", "seq_lens", "is_prefilling",
                         "prefill_len", "logits_indices", "segments", "per_rank_num_tokens",
                         "padded_gather_idx", "hidden_restore_idx", "kv_write_mask",
                         "block_table_global", "slot_mapping_global", "slot_mapping_gathered"}),
    "draft_0": frozenset({"view", "draft_tokens", "draft_last_token_indices", "draft_global_input_ids"}),
}


def _agreeing_views(phase: str, names) -> list[str]:
    if phase in _AGREE:
        return [v for v in names if v in _AGREE[phase]]
    k = draft_index(phase)
    if phase == "verify" or (k is not None and k >= 1):
        return [v for v in names if v not in TIMING_VIEWS and v not in DIGEST_VIEWS]
    return []


@_check("ranks_agree",
        "every rank of a step records the same global views: the global batch and layout, "
        "draft_tokens of every draft phase, the replicated draft decodes, and the whole verify "
        "outcome (sampled tokens, num_accepted/num_sampled)")
def ranks_agree(c: _Ctx) -> None:
    ranks = sorted(c.sv.recs)
    ref = ranks[0]
    if c.rank == ref:
        if c.sv.missing:
            r = c.sv.missing[0]
            c.fail(None, None, f"step {c.step} is missing on rank {r}, which recorded later steps",
                   rank=r)
        if len(ranks) == 1 and not c.sv.missing:
            raise _Skip("single rank")
        return
    mine, theirs = c.phases, c.sv.recs[ref]
    for phase in sorted(set(mine) | set(theirs), key=causal_phase_key):
        if phase not in mine or phase not in theirs:
            if not _agreeing_views(phase, (mine.get(phase) or theirs.get(phase)).keys()):
                continue
            c.fail(phase, None, f"phase {phase} recorded on rank {ref if phase in theirs else c.rank} "
                   f"but not on rank {c.rank if phase in theirs else ref}")
        a, b = theirs[phase], mine[phase]
        for view in _agreeing_views(phase, list(a.keys()) + [v for v in b.keys() if v not in a]):
            if view not in a or view not in b:
                c.fail(phase, view, f"recorded on rank {ref if view in a else c.rank} only")
            if view == "segments":
                ea = np.stack([a[view][f].astype(np.int64) for f in a[view].dtype.names], axis=-1) \
                    if a[view].dtype.names else a[view]
                eb = np.stack([b[view][f].astype(np.int64) for f in b[view].dtype.names], axis=-1) \
                    if b[view].dtype.names else b[view]
                c.expect(phase, view, ea, eb, f"differs from rank {ref}")
            else:
                c.expect(phase, view, a[view], b[view], f"differs from rank {ref}")


@_check("positions_consistent",
        "global positions are contiguous per request, seq_lens == last position + 1, the first "
        "position is <= the CPU cursor (num_computed_tokens), and a request continuing from the "
        "previous step starts at its previous first position + q - num_rejected (the GPU cursor)")
def positions_consistent(c: _Ctx) -> None:
    pos = c.t("positions").astype(np.int64)
    qsl = c.qsl()
    q = np.diff(qsl)
    t = int(qsl[-1])
    if pos.shape != (t,):
        c.fail("target", "positions", f"length {pos.shape}, expected T={t}")
    has = q > 0
    row = _token_rows(qsl)
    first = np.zeros(q.shape[0], dtype=np.int64)
    first[has] = pos[qsl[:-1][has]]
    c.expect("target", "positions", first[row] + (np.arange(t) - qsl[row]), pos,
             "positions of a request are not contiguous")
    sl = c.get("target", "seq_lens")
    hi = np.flatnonzero(has)
    if sl is not None:
        c.expect("target", "seq_lens", pos[qsl[1:][hi] - 1] + 1, sl.astype(np.int64)[hi],
                 "seq_len != last position + 1", index_map=lambda i: (int(hi[i[0]]),))
    nc = c.get("target", "num_computed_tokens")
    if nc is not None:
        above = has & (first > nc.astype(np.int64))
        if above.any():
            i = int(np.argmax(above))
            c.fail("target", "positions", f"request row {i} starts at {int(first[i])}, past its CPU "
                   f"cursor {int(nc[i])} (an upper bound of the GPU cursor)", index=(int(qsl[i]),),
                   expected=f"<= {int(nc[i])}", actual=str(int(first[i])))
    pv = c.prev()
    if pv is None or pv.get("target", "positions") is None or pv.get("verify", "num_rejected") is None:
        return
    prid, rid = pv.t("req_ids"), c.t("req_ids")
    pqsl = pv.qsl()
    pq = np.diff(pqsl)
    ppos = pv.t("positions").astype(np.int64)
    prej = pv.get("verify", "num_rejected").astype(np.int64)
    prow = {str(x): i for i, x in enumerate(prid.tolist())}
    cur = np.array([prow.get(str(x), -1) for x in rid.tolist()], dtype=np.int64)
    rows = np.flatnonzero((cur >= 0) & has)
    pr = cur[rows]
    rows, pr = rows[pq[pr] > 0], pr[pq[pr] > 0]
    if rows.size == 0:
        return
    expected = ppos[pqsl[:-1][pr]] + pq[pr] - prej[pr]
    c.expect("target", "positions", expected, first[rows],
             f"first position != step {pv.step}'s first position + q - num_rejected (GPU cursor)",
             index_map=lambda i: (int(qsl[rows[i[0]]]),))


CHECKS: Mapping[str, str] = MappingProxyType({d.name: d.description for d in _DEFS})
"""Every check name -> its one-line meaning, in the order they run and are reported."""


# --------------------------------------------------------------------------- the runner

class _Stats:
    __slots__ = ("evaluated", "failed", "skipped", "skip_reason", "first")

    def __init__(self) -> None:
        self.evaluated = self.failed = self.skipped = 0
        self.skip_reason: str | None = None
        self.first: Violation | None = None


def _meta_summary(meta: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("producer", "pcp", "dcp", "num_speculative_tokens", "block_size", "shard_decode_requests",
            "model", "vllm_version")
    return {k: meta.get(k) for k in keys if k in meta}


def run_checks(trace: Trace | str | os.PathLike, *, checks: list[str] | None = None) -> CheckReport:
    """Run every check (or the named ones) over every step and rank of ``trace``.

    ``trace`` is a ``pcpviz.trace.Trace`` or a run directory (opened with
    ``pcpviz.trace.open``; a ``TraceError`` propagates). A check whose inputs a step lacks is
    skipped there; a check that could run on no step at all gets the verdict ``skipped``.
    ``report.status`` is ``pcpviz.trace.validate(trace)``: an invalid run.json or an incomplete
    trace (lost steps, missing ranks) makes ``report.ok`` false even when every check passes.
    """
    t0 = time.perf_counter()
    if not isinstance(trace, Trace):
        trace = open_trace(trace)
    defs = list(_DEFS)
    if checks is not None:
        unknown = [n for n in checks if n not in CHECKS]
        if unknown:
            raise ValueError(f"unknown check {unknown[0]!r}; known: {', '.join(CHECKS)}")
        defs = [d for d in _DEFS if d.name in set(checks)]
    status = validate_trace(trace)  # run.json schema, run.json vs the data, completeness
    cfg = _Config.from_meta(trusted_meta(trace.meta, status))
    stats = {d.name: _Stats() for d in defs}
    ranks = trace.ranks
    last_step = {r: (trace.rank_steps(r)[-1] if trace.rank_steps(r) else None) for r in ranks}
    rank_steps = {r: set(trace.rank_steps(r)) for r in ranks}
    prev: _StepView | None = None
    for step in trace.steps:
        recs = {}
        for r in ranks:
            if step in rank_steps[r]:
                recs[r] = {ph: trace.record(step, r, ph) for ph in trace.phases(step, r)}
        missing = tuple(r for r in ranks if step not in rank_steps[r]
                        and last_step[r] is not None and last_step[r] > step)
        sv = _StepView(step, recs, prev, missing)
        for r in recs:
            for d in defs:
                st = stats[d.name]
                try:
                    d.fn(_Ctx(cfg, sv, r, d.name))
                    st.evaluated += 1
                except _Skip as s:
                    st.skipped += 1
                    if st.skip_reason is None:
                        st.skip_reason = f"step {step} rank {r}: {s}"
                except _Fail as f:
                    st.evaluated += 1
                    st.failed += 1
                    if st.first is None:
                        st.first = Violation(**f.kw)
                except (IndexError, ValueError, TypeError, KeyError) as exc:
                    st.evaluated += 1
                    st.failed += 1
                    if st.first is None:
                        msg = " ".join(str(exc).split())
                        st.first = Violation(d.name, step, r, None, None,
                                             f"could not evaluate (malformed views?): "
                                             f"{type(exc).__name__}: {msg}")
        if prev is not None:
            prev.prev = None  # keep only one step of history
        prev = sv
    results = {}
    for d in defs:
        st = stats[d.name]
        if st.failed:
            verdict = FAIL
        elif st.evaluated:
            verdict = PASS
        else:
            verdict = SKIPPED
        reason = st.skip_reason if st.skip_reason is not None or trace.steps else "the trace has no steps"
        results[d.name] = CheckResult(d.name, d.description, verdict, st.evaluated, st.failed,
                                      st.skipped, reason, st.first)
    return CheckReport(str(trace.path), MappingProxyType(_meta_summary(trace.meta)), len(trace.steps),
                       tuple(ranks), MappingProxyType(results), time.perf_counter() - t0, status)
