"""Sizes a trace file dictates, bounded before anything is allocated from them.

A rank file with valid framing can still say anything: a position of 2**62 (a block table
2**58 columns wide), ``num_scheduled_tokens`` of 2**40 (a slot mapping of 8 TiB), a
40-dimensional ``positions``, a 10 MB request id. ``step_problems`` reads one step's views
(no allocation bigger than the views themselves) and returns one line per view that breaks a
bound; every consumer (the checks, diff, the figures and exports, explain) treats a step with
problems as malformed and never computes sizes from it. A PCP=2 step::

    target.num_scheduled_tokens [3, 9] with positions of 12 tokens    -> []
    target.num_scheduled_tokens [3, 2**40]                            ->
        ["target.num_scheduled_tokens: sums to 1099511627779, but positions holds 12 tokens"]
    target.positions holding 2**62                                    ->
        ["target.positions: holds 4611686018427387904, more than the bound 2147483647"]
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from pcpviz.limits import MAX_INDEX, MAX_NDIM, MAX_STRING_CHARS, MAX_TOKENS

from . import schema as S

__all__ = ["step_problems", "well_formed", "problems_at"]


_INDEX_VIEWS = frozenset({
    "positions", "seq_lens", "num_scheduled_tokens", "num_computed_tokens", "prefill_len",
    "query_start_loc", "logits_indices", "num_draft_tokens", "per_rank_num_tokens",
    "padded_gather_idx", "hidden_restore_idx", "local_positions", "local_seq_lens",
    "local_query_start_loc", "draft_positions", "draft_seq_lens", "draft_last_token_indices",
    "draft_query_start_loc", "draft_context_positions", "num_sampled", "num_rejected",
    "num_accepted", "sampled_logits_rows", "block_table_global", "block_table_local",
    "block_table_draft", "slot_mapping_global", "slot_mapping_gathered", "slot_mapping_local",
    "slot_mapping_draft", "draft_context_slot_mapping", "idx_mapping", "local_idx_mapping",
    "num_reqs",
})
"""Integer views used as sizes or indices: each value must lie in ``-1 .. MAX_INDEX`` (-1 is
the padding of slot mappings and masked rows)."""


def _int_problem(name: str, a: np.ndarray) -> str | None:
    if a.dtype.kind not in "iuf" or a.size == 0:
        return None
    if a.dtype.kind == "f":  # NaN and 2.5 are the readers' (``schema.int_view``) to report
        a = a[np.isfinite(a)]
        if a.size == 0:
            return None
    lo, hi = a.min(), a.max()
    if hi > MAX_INDEX:
        return f"{name}: holds {int(hi)}, more than the bound {MAX_INDEX}"
    if lo < -1:
        return f"{name}: holds {int(lo)}, less than -1"
    return None


@lru_cache(maxsize=8192)
def _spec(phase: str, name: str) -> Any:
    return S.view_spec(phase, name)


def _view_problem(phase: str, name: str, value: Any) -> str | None:
    a = value if type(value) is np.ndarray else np.asarray(value)
    where = f"{phase}.{name}"
    if a.ndim > MAX_NDIM:
        return f"{where}: {a.ndim}-d, at most {MAX_NDIM} axes"
    if a.ndim == 1 and a.shape[0] > MAX_TOKENS:
        return f"{where}: {a.shape[0]} entries, more than the bound {MAX_TOKENS}"
    spec = _spec(phase, name) if S.is_valid_phase(phase) and isinstance(name, str) else None
    if spec is not None:
        floats_for_ints = a.dtype.kind == "f" and spec.dtype.startswith(("int", "uint"))
        why = f"{a.ndim}-d, declared {spec.shape}" if floats_for_ints and a.ndim not in spec.ndims \
            else None if floats_for_ints else spec.problem(a)
        if why:
            return f"{where}: {why}"
    if a.dtype.kind == "U" and a.size and a.dtype.itemsize // 4 > MAX_STRING_CHARS:
        longest = max(len(s) for s in a.ravel().tolist())
        if longest > MAX_STRING_CHARS:
            return f"{where}: a string of {longest} characters, more than the bound {MAX_STRING_CHARS}"
    if a.dtype.names is not None:
        for field in a.dtype.names:
            bad = _int_problem(f"{where}[{field!r}]", a[field])
            if bad:
                return bad
    elif name in _INDEX_VIEWS:
        return _int_problem(where, a)
    return None


def _token_count_problem(target: Mapping[str, Any]) -> str | None:
    """num_scheduled_tokens, query_start_loc and the token axis must agree."""
    t = next((np.asarray(target[v]).shape[0] for v in ("positions", "input_ids")
              if v in target and np.asarray(target[v]).ndim == 1), None)
    q = target.get("num_scheduled_tokens")
    qsl = target.get("query_start_loc")
    if q is not None:
        q = np.asarray(q).astype(np.int64)
        if q.ndim == 1 and (q < 0).any():
            return f"target.num_scheduled_tokens: holds {int(q.min())}, a negative count"
        if q.ndim == 1 and t is not None and int(q.sum()) != t:
            return f"target.num_scheduled_tokens: sums to {int(q.sum())}, but positions holds {t} tokens"
    if qsl is not None:
        qsl = np.asarray(qsl).astype(np.int64)
        if qsl.ndim != 1 or qsl.size == 0:
            return None  # the schema line above reports the shape
        if int(qsl[0]) != 0 or (np.diff(qsl) < 0).any():
            return f"target.query_start_loc: {_head(qsl)} does not rise from 0"
        if t is not None and int(qsl[-1]) != t:
            return f"target.query_start_loc: ends at {int(qsl[-1])}, but positions holds {t} tokens"
        if q is not None and q.ndim == 1 and (q.shape[0] + 1 != qsl.shape[0]
                                              or not np.array_equal(np.diff(qsl), q)):
            return (f"target.query_start_loc: {_head(qsl)} is not the running sum of "
                    f"num_scheduled_tokens {_head(q)}")
    return None


def _head(a: np.ndarray) -> str:
    vals = a.ravel()[:6].tolist()
    return "[" + ", ".join(map(str, vals)) + (", ...]" if a.size > 6 else "]")


def step_problems(phases: Mapping[str, Mapping[str, Any]], *, memo: dict | None = None) -> list[str]:
    """One line per view of one step on one rank (``{phase: {view: array}}``) that breaks a
    bound: too many axes or entries, a shape or dtype its declaration does not allow, an index
    outside ``-1 .. MAX_INDEX``, a string longer than ``MAX_STRING_CHARS``, or token counts
    (num_scheduled_tokens, query_start_loc, the token axis) that disagree. ``memo`` (one step's,
    shared by its ranks) remembers each view array's answer: ranks recording a view byte-equal
    read one array (``pcpviz.trace.reader``), which is judged once."""
    out = []
    for phase, views in phases.items():
        for name, value in views.items():
            key = (phase, name, id(value))
            seen = None if memo is None else memo.get(key)
            if seen is not None and seen[0] is value:
                why = seen[1]
            else:
                why = _view_problem(phase, name, value)
                if memo is not None:
                    memo[key] = (value, why)
            if why:
                out.append(why)
    target = phases.get(S.PHASE_TARGET)
    if target is not None and not any(p.startswith("target.") for p in out):
        why = _token_count_problem(target)
        if why:
            out.append(why)
    return out


def problems_at(trace: Any, step: int, rank: int) -> list[str]:
    """``step_problems`` of ``step`` on ``rank`` of an open trace."""
    return step_problems({ph: trace.record(step, rank, ph) for ph in trace.phases(step, rank)})


def well_formed(trace: Any, step: int, rank: int) -> bool:
    """True if ``step`` on ``rank`` breaks no bound (``step_problems``)."""
    return not problems_at(trace, step, rank)
