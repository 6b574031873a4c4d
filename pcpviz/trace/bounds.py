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

import math
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

from pcpviz.limits import MAX_INDEX, MAX_NDIM, MAX_STRING_CHARS, MAX_TOKENS

from . import schema as S

__all__ = ["step_problems", "well_formed", "problems_at", "rows_clean"]


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


def step_problems(phases: Mapping[str, Mapping[str, Any]], *, memo: dict | None = None,
                  clean: bool = False) -> list[str]:
    """One line per view of one step on one rank (``{phase: {view: array}}``) that breaks a
    bound: too many axes or entries, a shape or dtype its declaration does not allow, an index
    outside ``-1 .. MAX_INDEX``, a string longer than ``MAX_STRING_CHARS``, or token counts
    (num_scheduled_tokens, query_start_loc, the token axis) that disagree. ``memo`` (one step's,
    shared by its ranks) remembers each view array's answer: ranks recording a view byte-equal
    read one array (``pcpviz.trace.reader``), which is judged once.

    The work is done in bulk (``_bulk_problems``): the shape and dtype rules once per (view,
    dtype, axes), the index bounds as one min and max over all of the step's integer index
    views of a dtype; only when a bound breaks is each view judged alone (``_view_problem``),
    which names it. Both give the same lines, in the same order. A step that breaks no bound is
    told first by ``_clean``, one pass over its views (the common case, and the one that costs).
    ``clean``: the caller knows ``_clean`` would say True (``rows_clean`` said so of the step's
    rows): only the token counts are judged."""
    if clean or _clean(phases, memo):
        target = phases.get(S.PHASE_TARGET)
        why = None if target is None else _token_count_memo(target, memo)
        return [why] if why else []
    out = []
    pending: list[tuple[str, str, Any, Any]] = []  # (phase, name, value, memo key) not in the memo
    for phase, views in phases.items():
        for name, value in views.items():
            key = (phase, name, id(value))
            seen = None if memo is None else memo.get(key)
            if seen is not None and seen[0] is value:
                if seen[1]:
                    out.append(seen[1])
                continue
            pending.append((phase, name, value, key))
    if pending:
        whys = _bulk_problems(pending)
        for (phase, name, value, key), why in zip(pending, whys):
            if memo is not None:
                memo[key] = (value, why)
        if out or any(whys):  # keep the views' order: judged again in order
            out = [why for phase, views in phases.items() for name, value in views.items()
                   for why in (_memo_or_judge(memo, phase, name, value),) if why]
    target = phases.get(S.PHASE_TARGET)
    if target is not None and not any(p.startswith("target.") for p in out):
        why = _token_count_problem(target)
        if why:
            out.append(why)
    return out


_KIND: dict[tuple, Any] = {}
"""(phase, name, dtype, axes) -> how ``_clean`` reads such a view: ``""`` nothing more, ``"i"``
an integer index view (bounds by group), a tuple of field names a table's integer fields
(bounds by group), ``None`` only ``step_problems``' full path can say."""


_UNSEEN = object()


def _kind(phase: Any, name: Any, a: np.ndarray) -> Any:
    key = (phase, name, a.dtype, a.ndim)
    try:
        return _KIND[key]
    except (KeyError, TypeError):
        pass
    probe = np.zeros((0,) * a.ndim, dtype=a.dtype)  # the dtype and axes only: never a long axis
    kind: str | None = ""
    if _static_problem(phase, name, probe) is not None:
        kind = None
    elif a.dtype.names is not None:
        kinds = {f: a.dtype[f].kind for f in a.dtype.names}
        kind = None if "f" in kinds.values() else tuple(f for f, k in kinds.items() if k in "iu")
    elif a.dtype.kind == "U":
        kind = None if a.dtype.itemsize // 4 > MAX_STRING_CHARS else ""
    elif name in _INDEX_VIEWS:
        kind = "i" if a.dtype.kind in "iu" else None if a.dtype.kind == "f" else ""
    if len(_KIND) >= _STATIC_MAX:
        _KIND.clear()
    _KIND[key] = kind
    return kind


def _clean(phases: Mapping[str, Mapping[str, Any]], memo: dict | None) -> bool:
    """True only if ``step_problems`` finds no view of the step breaking a bound (its token-count
    line aside), told in one pass: each view's dtype and axes classed once (``_kind``), the
    integer index views' bounds one min and max per dtype (NumPy: a step's views are a few dozen
    small arrays, where pyarrow.compute's or polars' fixed cost per call is more than the work).
    False sends the step to the full path (which names what breaks, in order). The views judged
    here go into ``memo`` as clean."""
    groups: dict[np.dtype, list[np.ndarray]] = {}
    fresh = []
    kinds = _KIND
    for phase, views in phases.items():
        for name, a in getattr(views, "views", views).items():
            if memo is not None:  # by id alone (an int: no key tuple per view), the rest checked
                seen = memo.get(id(a))
                if seen is not None and seen[0] is a and seen[1] == phase and seen[2] == name:
                    continue
                fresh.append((phase, name, a))
            if type(a) is not np.ndarray:
                return False
            ndim = a.ndim
            if ndim == 1 and a.shape[0] > MAX_TOKENS:
                return False
            kind = kinds.get((phase, name, a.dtype, ndim), _UNSEEN)  # _kind's memo, read inline
            if kind is _UNSEEN:
                kind = _kind(phase, name, a)
            if kind is None:
                return False
            if kind == "i" and a.size:
                group = groups.get(a.dtype)
                if group is None:
                    group = groups[a.dtype] = []
                group.append(a if ndim == 1 else a.ravel())
            elif kind and a.size:
                for field in kind:
                    f = a[field]
                    groups.setdefault(f.dtype, []).append(f.ravel())
    for arrays in groups.values():
        flat = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        if flat.max() > MAX_INDEX or flat.min() < -1:
            return False
    if memo is not None:
        for phase, name, a in fresh:
            memo[id(a)] = (a, phase, name)  # clean (only clean views are kept under an id)
    return True


def _token_count_memo(target: Mapping[str, Any], memo: dict | None) -> str | None:
    """``_token_count_problem``, once per step for the ranks whose four views it reads are the
    very arrays another rank's were (the global batch: the reader shares them)."""
    views = getattr(target, "views", target)
    objs = tuple(views.get(v) for v in ("positions", "input_ids", "num_scheduled_tokens", "query_start_loc"))
    key = ("tokens", *map(id, objs))
    seen = None if memo is None else memo.get(key)
    if seen is not None and all(a is b for a, b in zip(seen[0], objs)):
        return seen[1]
    why = _token_count_problem(target)
    if memo is not None:
        memo[key] = (objs, why)
    return why


def _memo_or_judge(memo: dict | None, phase: str, name: str, value: Any) -> str | None:
    seen = None if memo is None else memo.get((phase, name, id(value)))
    return seen[1] if seen is not None and seen[0] is value else _view_problem(phase, name, value)


_STATIC: dict[tuple, str | None] = {}
_STATIC_MAX = 1 << 16


def _static_problem(phase: Any, name: Any, a: np.ndarray) -> str | None:
    """The part of ``_view_problem`` that depends on the dtype and axes only (memoized)."""
    key = (phase, name, a.dtype, a.ndim, a.ndim == 1 and a.shape[0] > MAX_TOKENS)
    try:
        return _STATIC[key]
    except (KeyError, TypeError):
        pass
    where = f"{phase}.{name}"
    why = None
    if a.ndim > MAX_NDIM:
        why = f"{where}: {a.ndim}-d, at most {MAX_NDIM} axes"
    elif a.ndim == 1 and a.shape[0] > MAX_TOKENS:
        why = f"{where}: {a.shape[0]} entries, more than the bound {MAX_TOKENS}"
    else:
        spec = _spec(phase, name) if S.is_valid_phase(phase) and isinstance(name, str) else None
        if spec is not None:
            floats_for_ints = a.dtype.kind == "f" and spec.dtype.startswith(("int", "uint"))
            why = f"{a.ndim}-d, declared {spec.shape}" if floats_for_ints and a.ndim not in spec.ndims \
                else None if floats_for_ints else spec.problem(a)
            why = f"{where}: {why}" if why else None
    if len(_STATIC) >= _STATIC_MAX:
        _STATIC.clear()
    _STATIC[key] = why
    return why


def _bulk_problems(pending: list[tuple[str, str, Any, Any]]) -> list[str | None]:
    """``_view_problem`` of each pending view, with the index bounds of all integer views of one
    dtype checked at once (one concatenation, one min, one max)."""
    whys: list[str | None] = []
    groups: dict[np.dtype, list[np.ndarray]] = {}
    alone: list[int] = []  # views judged by ``_view_problem`` (floats, long strings)
    for i, (phase, name, value, _) in enumerate(pending):
        a = value if type(value) is np.ndarray else np.asarray(value)
        why = _static_problem(phase, name, a)
        whys.append(why)
        if why or a.size == 0:
            continue
        if a.dtype.names is not None:
            for field in a.dtype.names:
                f = a[field]
                if f.dtype.kind in "iu":
                    groups.setdefault(f.dtype, []).append(f.ravel())
                elif f.dtype.kind == "f":
                    alone.append(i)
        elif a.dtype.kind == "U":
            if a.dtype.itemsize // 4 > MAX_STRING_CHARS:
                alone.append(i)
        elif name in _INDEX_VIEWS:
            if a.dtype.kind in "iu":
                groups.setdefault(a.dtype, []).append(a.ravel())
            elif a.dtype.kind == "f":
                alone.append(i)
    for dt, arrays in groups.items():
        flat = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        if flat.max() > MAX_INDEX or flat.min() < -1:
            alone = range(len(pending))  # some view breaks a bound: each judged alone names it
            break
    for i in alone:
        if whys[i] is None:
            whys[i] = _view_problem(pending[i][0], pending[i][1], pending[i][2])
    return whys


def problems_at(trace: Any, step: int, rank: int) -> list[str]:
    """``step_problems`` of ``step`` on ``rank`` of an open trace."""
    return step_problems({ph: trace.record(step, rank, ph) for ph in trace.phases(step, rank)})


def well_formed(trace: Any, step: int, rank: int) -> bool:
    """True if ``step`` on ``rank`` breaks no bound (``step_problems``)."""
    return not problems_at(trace, step, rank)


PLAN_ELEMENTS = 1 << 12
"""Index elements of a (step, rank) past which ``rows_clean`` leaves the step to ``_clean`` (a
long prompt's views are bounded faster as they are than gathered)."""

PLANS_KEPT = 512
"""``rows_clean``'s plans remembered (by layout and shape column): at most 512 x 2 x 4,096
int64s (32 MiB) where every step has other shapes."""

_PLANS: dict[tuple[int, int], tuple] = {}
_BYTES = {n: np.arange(n, dtype=np.int64) for n in (1, 2, 4, 8)}


def _rows_plan(layout: Any, shapes: Sequence[tuple[int, ...]]) -> Any:
    """What ``rows_clean`` reads of a batch of ``layout`` with ``shapes``, made once per (layout,
    shape column), both shared by the steps that repeat them: (string rows as (row, phase,
    name), per dtype (dtype, row of each index element, its byte offset in the row)); None where
    ``_clean`` must walk the views (a view too long, a kind only the full path judges, too many
    elements)."""
    key = (id(layout), id(shapes))
    got = _PLANS.get(key)
    if got is not None and got[0] is layout and got[1] is shapes:
        return got[2]
    strings, groups, total = [], {}, 0
    plan: Any = None
    for j, (phase, name, dt, shape) in enumerate(zip(layout.phase_of, layout.views, layout.dtypes, shapes)):
        if len(shape) == 1 and shape[0] > MAX_TOKENS:
            break
        if dt is None:
            strings.append((j, phase, name))
            continue
        kind, count = _kind(phase, name, np.zeros((0,) * len(shape), dtype=dt)), math.prod(shape)
        if kind is None:
            break
        fields = ((dt, 0),) if kind == "i" else tuple((dt[f], dt.fields[f][1]) for f in kind or ())
        if any(fd.itemsize not in _BYTES for fd, _ in fields) or total + count * len(fields) > PLAN_ELEMENTS:
            break
        for fd, at in fields if count else ():
            rows, rel = groups.setdefault(fd, ([], []))
            rows.append(np.full(count, j, dtype=np.int64))
            rel.append(np.arange(count, dtype=np.int64) * dt.itemsize + at)
            total += count
    else:
        plan = (tuple(strings), tuple((fd, np.concatenate(r), np.concatenate(o)) for fd, (r, o) in groups.items()))
    if len(_PLANS) >= PLANS_KEPT:
        _PLANS.clear()
    _PLANS[key] = (layout, shapes, plan)
    return plan


def rows_clean(layout: Any, shapes: Sequence[tuple[int, ...]], offsets: np.ndarray, *, u8: np.ndarray,
               strings: Mapping[int, Any]) -> bool:
    """True only where ``_clean`` says True of a step's records decoded from one batch (``layout``
    and ``shapes`` as ``batches.Layout`` and ``batches.Loaded`` give them, ``offsets`` int64[n + 1]
    its rows' payload offsets into ``u8``, every numeric row decoded as a view of its bytes;
    ``strings``: the decoded array of each string row, by row): the index bounds as one gather,
    min and max per dtype over the payload bytes, the rest known per (layout, shapes). False:
    ask ``_clean`` (which may still say True). Two int64 index rows holding [0, 5] and [2**40]:
    False; holding [0, 5] and [-1]: True."""
    plan = _rows_plan(layout, shapes)
    if plan is None:
        return False
    texts, groups = plan
    for j, phase, name in texts:
        a = strings[j]
        if type(a) is not np.ndarray:
            return False
        kind = _KIND.get((phase, name, a.dtype, a.ndim), _UNSEEN)
        if kind is _UNSEEN:
            kind = _kind(phase, name, a)
        if kind != "":
            return False
    for dt, rows, rel in groups:
        at = offsets[rows] + rel
        vals = u8[at[:, None] + _BYTES[dt.itemsize]].view(dt)
        if vals.max() > MAX_INDEX or vals.min() < -1:
            return False
    return True
