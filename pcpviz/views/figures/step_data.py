"""Data loading for the trace views: the record mappings of one step, the PCP layout rebuilt
from them (``StepLayout``), which draft phase the draft panels show, the trace's request ids and
its check report.

A record is what ``trace.record(step, rank, phase)`` returns: view name -> NumPy array. For a
PCP=2 step of the shipped trace (``cpu-pcp2-mtp2`` step 0: req0 prefills 23 tokens, req1 25)
``step_layout(target)`` gives N = 2, P = 26, per-rank tokens [22, 26], and ``token_chunk`` the
DualChunkSwap chunk of each of the 48 global tokens (chunks of ceil(23/4) = 6 and ceil(25/4) = 7).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from pcpviz.reference.batch import record_query_start_loc
from pcpviz.reference.chunks import chunk_size
from pcpviz.trace.bounds import step_problems
from pcpviz.trace.reader import Record
from pcpviz.trace.schema import DRAFT_VIEW_REPLICATED, SEGMENT_DTYPE, int_view, view_spec
from pcpviz.trace.shapes import table_groups, view_text

__all__ = ["view_array", "is_replicated", "StepLayout", "step_layout", "has_layout", "single_rank",
           "LAYOUT_INPUT_VIEWS", "layout_summary", "recorded_phases", "draft_source_phase", "trace_req_ids",
           "load_check_report", "ReqIdsFold"]


def view_array(rec: Record | None, name: str, default=None):
    """``rec[name]`` as an array, ``default`` when ``rec`` is None or lacks the view. An integer
    view a file stored as floats is read as int64 when it holds whole numbers; NaN, inf or 2.5
    raise ``MalformedValue`` naming the view (the commands exit 3: damaged data)."""
    if rec is None or name not in rec:
        return default
    a = np.asarray(rec[name])
    if a.dtype.kind == "f":
        spec = view_spec(rec.phase, name)
        if spec is not None and spec.dtype.startswith(("int", "uint")):
            return int_view(a, f"step {rec.step} rank {rec.rank} {rec.phase}.{name}")
    return a


@dataclass(frozen=True)
class StepLayout:
    """The PCP layout of one step, rebuilt from the recorded ``target`` views."""

    req_ids: tuple[str, ...]
    num_scheduled_tokens: np.ndarray  # int64[R]
    query_start_loc: np.ndarray  # int64[R+1]
    pcp: int  # N
    padded: int  # P
    per_rank_num_tokens: np.ndarray  # int64[N]
    padded_gather_idx: np.ndarray  # int64[N*P]
    hidden_restore_idx: np.ndarray  # int64[T]
    kv_write_mask: np.ndarray  # bool[N*P]
    segments: np.ndarray  # SEGMENT_DTYPE[S]
    token_req: np.ndarray  # int64[T]: global row of each global token
    token_chunk: np.ndarray  # int64[T]: DualChunkSwap chunk of each global token (0 if whole)
    row_real: np.ndarray  # bool[N*P]: gathered row holds a token

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1]) if self.query_start_loc.size else 0

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def row_req(self) -> np.ndarray:
        """int64[N*P]: global request row of each gathered row, -1 on padding."""
        t = self.num_tokens
        g = np.clip(self.padded_gather_idx, 0, max(t - 1, 0))
        return np.where(self.row_real & (t > 0), self.token_req[g] if t else -1, -1)

    def row_status(self) -> np.ndarray:
        """int8[N*P]: 2 written, 1 real but masked to PAD (an extra replica), 0 padding."""
        return np.where(self.kv_write_mask, 2, np.where(self.row_real, 1, 0)).astype(np.int8)


_LAYOUT_CACHE_SIZE = 16
_layouts: OrderedDict[int, tuple[Record, StepLayout]] = OrderedDict()


def step_layout(target: Record) -> StepLayout:
    """``StepLayout`` of a ``target`` record (needs the global-batch and layout views).

    A trace's ``Record`` is read-only, so its layout is computed once and kept for the last
    ``_LAYOUT_CACHE_SIZE`` records (each figure of a step asks for it); other mappings are
    recomputed on every call.
    """
    if not isinstance(target, Record):
        return _step_layout(target)
    hit = _layouts.get(id(target))
    if hit is not None and hit[0] is target:
        _layouts.move_to_end(id(target))
        return hit[1]
    sl = _step_layout(target)
    _layouts[id(target)] = (target, sl)
    while len(_layouts) > _LAYOUT_CACHE_SIZE:
        _layouts.popitem(last=False)
    return sl


def recorded_phases(trace: Any, step: int, rank: int) -> list[str]:
    """The phases ``step`` holds on ``rank``, [] when that rank has not (yet) recorded it (a trace
    still being written, or damaged, holds some steps on some ranks only)."""
    if rank not in trace.files or step not in set(trace.rank_steps(rank)):
        return []
    return trace.phases(step, rank)


LAYOUT_INPUT_VIEWS = ("per_rank_num_tokens", "padded_gather_idx", "kv_write_mask", "hidden_restore_idx")
"""The target views a PCP layout is rebuilt from."""


def single_rank(target: Record | None) -> bool:
    """``target`` comes from a PCP=1 run that recorded no layout: with one rank the local batch
    is the global batch, so ``step_layout`` lays it out as the identity (P = T, every row written).

    Only a record that knows its run is PCP=1 (``Record.pcp``, from run.json) qualifies: a PCP>1
    record missing its layout views is damaged, and is never drawn as if it were PCP=1."""
    return (target is not None and getattr(target, "pcp", None) == 1
            and not any(v in target for v in LAYOUT_INPUT_VIEWS))


def has_layout(target: Record | None) -> bool:
    """``step_layout(target)`` has what it needs: recorded layout views, or a PCP=1 record."""
    return target is not None and ("per_rank_num_tokens" in target or single_rank(target))


def layout_summary(target: Record | None) -> str | None:
    """``T=48, R=2, P=26, per-rank [22, 26]`` for a target record with a layout (None without
    one); for a malformed one what is wrong, as text (escape it for HTML)."""
    if not has_layout(target):
        return None
    try:
        sl = step_layout(target)
    except (IndexError, ValueError, TypeError, KeyError) as exc:
        return f"cannot lay out this step: {' '.join(str(exc).split())[:200]}"
    return f"T={sl.num_tokens}, R={sl.num_reqs}, P={sl.padded}, per-rank {sl.per_rank_num_tokens.tolist()}"


def _step_layout(target: Record) -> StepLayout:
    problems = step_problems({"target": target})
    if problems:  # sizes from a malformed record are never allocated
        raise ValueError(f"malformed views: {problems[0]}")
    req_ids = tuple(str(x) for x in np.asarray(target["req_ids"]).ravel())
    q = np.asarray(target["num_scheduled_tokens"], dtype=np.int64)
    qsl = record_query_start_loc(target)
    if single_rank(target):  # PCP=1: rank 0's rows are the global tokens, all written
        t1 = int(qsl[-1]) if qsl.size else 0
        per_rank = np.array([t1], dtype=np.int64)
        gather = restore = np.arange(t1, dtype=np.int64)
        mask = np.ones(t1, dtype=bool)
    else:
        per_rank = np.asarray(target["per_rank_num_tokens"], dtype=np.int64)
        gather = np.asarray(target["padded_gather_idx"], dtype=np.int64)
        mask = np.asarray(target["kv_write_mask"], dtype=bool)
        restore = np.asarray(target["hidden_restore_idx"], dtype=np.int64)
    n = int(per_rank.shape[0])
    p = gather.shape[0] // max(n, 1)
    segs = target.get("segments")
    segs = np.zeros(0, dtype=SEGMENT_DTYPE) if segs is None else np.asarray(segs)
    t = int(qsl[-1]) if qsl.size else 0
    token_req = np.repeat(np.arange(q.shape[0]), q) if t else np.zeros(0, np.int64)
    # A request is "whole" (decode-like: sharded to one rank or replicated) when one segment
    # covers its whole query; otherwise DualChunkSwap cut it into 2N chunks of ceil(q/2N).
    whole = np.zeros(q.shape[0], dtype=bool)
    if not segs.size and "is_prefilling" in target:  # no segments recorded: decodes are whole
        whole = ~np.asarray(target["is_prefilling"], dtype=bool)[: q.shape[0]]
    if segs.size:
        gi = segs["global_req_idx"].astype(np.int64)
        ok = (gi >= 0) & (gi < q.shape[0])
        cover = (segs["global_start"][ok] == qsl[gi[ok]]) & (segs["global_stop"][ok] == qsl[gi[ok] + 1])
        whole[gi[ok][cover]] = True
    size = np.maximum(chunk_size(q, max(n, 1)), 1)  # the reference's ceil(q / 2N), never 0
    if t:
        offset = np.arange(t) - qsl[token_req]
        token_chunk = np.where(whole[token_req], 0, offset // size[token_req])
    else:
        token_chunk = np.zeros(0, np.int64)
    local = np.arange(p)
    row_real = (local[None, :] < per_rank[:, None]).ravel()
    return StepLayout(req_ids, q, qsl, n, p, per_rank, gather, restore, mask, segs,
                      token_req, token_chunk.astype(np.int64), row_real)



def draft_source_phase(phases: Iterable[str], selected: str | None) -> str | None:
    """The draft phase the draft panels show: the selected one if it is a draft step, else
    draft_1 (the first replicated one, where the gather matters), else draft_0."""
    phases = list(phases)
    if selected is not None and selected.startswith("draft_") and selected in phases:
        return selected
    for cand in ("draft_1", "draft_0"):
        if cand in phases:
            return cand
    drafts = [p for p in phases if p.startswith("draft_")]
    return drafts[0] if drafts else None


def is_replicated(draft: Record, target: Record | None) -> bool:
    """The draft phase ran on the replicated layout view (every rank, the global rows): its
    ``view`` field says so, or (traces without it) its block table has one row per request."""
    v = view_array(draft, "view")
    if v is not None:
        return view_text(v) == DRAFT_VIEW_REPLICATED
    bt = table_groups(view_array(draft, "block_table_draft"))
    return target is not None and bt is not None and bt.shape[1] == len(np.asarray(target["req_ids"]))


def _pad_cols(a: np.ndarray, w: int) -> np.ndarray:
    if a.shape[-1] >= w:
        return a[..., :w]
    pad = [(0, 0)] * (a.ndim - 1) + [(0, w - a.shape[-1])]
    return np.pad(a, pad)



def load_check_report(trace: Any, *, folds: Mapping[str, Any] | None = None,
                      workers: int | None = None) -> Any | None:
    """``pcpviz.analysis.checks.run_checks(trace, folds=folds, workers=workers)`` (imported on first
    use: the figures alone do not need it)."""
    from pcpviz.analysis.checks import run_checks  # noqa: PLC0415

    return run_checks(trace, folds=folds, workers=workers)


def trace_req_ids(trace: Any, report: Any = None) -> list[str]:
    """Every request id of the trace, in order of first appearance (first rank); ``report``: a
    check report whose pass counted them (``folds={"req_ids": ReqIdsFold(trace)}``), else one pass
    over the first rank's steps here."""
    folded = None if report is None else getattr(report, "folds", {}).get("req_ids")
    if folded is not None:
        return list(folded)
    state: dict[str, None] = {}
    rank = trace.ranks[0]
    for s in trace.rank_steps(rank):
        for ph in _REQ_ID_PHASES:
            if trace.has(s, rank, ph):
                _add_req_ids(state, trace.record(s, rank, ph))
                break
    return list(state)


_REQ_ID_PHASES = ("target", "verify")


def _add_req_ids(state: dict[str, None], rec: Any) -> None:
    if "req_ids" in rec:
        for r in np.asarray(rec["req_ids"]).ravel():
            state.setdefault(str(r), None)


class ReqIdsFold:
    """``trace_req_ids`` counted in the pass ``run_checks`` makes (``pcpviz.analysis.checks.StepFold``):
    each step's first of ``target`` and ``verify`` on the first rank, its ``req_ids`` in order."""

    def __init__(self, trace: Any) -> None:
        self.rank = trace.ranks[0]

    def start(self) -> dict[str, None]:
        return {}

    def add(self, state: dict[str, None], sv: Any) -> dict[str, None]:
        recs = sv.recs.get(self.rank)
        if recs is not None:
            for ph in _REQ_ID_PHASES:
                if ph in recs:
                    _add_req_ids(state, recs[ph])
                    break
        return state

    def merge(self, states: list[dict[str, None]]) -> list[str]:
        out: dict[str, None] = {}
        for state in states:
            for rid in state:
                out.setdefault(rid, None)
        return list(out)
