"""Checks over a block of steps at once: a ``Block`` is a run of consecutive steps' records
(``StepView``) read as columns (a view's values of every step, concatenated, with offsets), and
a check's *bulk rule* decides from the columns, with NumPy over the whole block, on which
(step, rank) the check passes for sure. The runner counts those as passed without running the
check there; every other (step, rank) (a failure, a skip, anything the rule cannot decide) runs
the check's per-step code as before, so first failures, counts and messages are unchanged.

A rule is declared next to its check, with the check's name::

    @bulk_rule("local_positions_are_global")
    def _local_positions_bulk(b: Block, rank: int) -> np.ndarray:
        ...  # bool[len(b)]: True where the check passes on (step, rank) for sure

A rule must be sound (True only where the per-step code passes: no Fail, no Skip, no error) and
may be conservative (False is always safe). A rule that raises decides nothing (every step of
the block runs per step). ``$PCPVIZ_BULK`` = ``0`` turns the rules off; ``verify`` runs every
check per step as well and raises AssertionError where a rule said pass and the check did not.
The rules run on blocks of many small steps (``runner.BULK_MIN_STEPS``, ``BULK_RANK_STEP_BYTES``),
on every block with ``always`` or ``verify``.

A column of a PCP=2 block of three steps, ``positions`` on rank 0::

    >>> col = Column.of([np.array([0, 1, 2]), None, np.array([7])])
    >>> col.values.tolist(), col.offsets.tolist(), col.present.tolist()
    ([0, 1, 2, 7], [0, 3, 3, 4], [True, False, True])
"""

from __future__ import annotations

import os
from operator import is_
from typing import Any, Callable, Sequence

import numpy as np

from .context import Ctx

BULK_ENV = "PCPVIZ_BULK"
"""``0``: no bulk rules (every check per step); ``always``: rules on every block (not only on
blocks of many small steps, ``runner.BULK_MIN_STEPS``); ``verify``: ``always``, and every rule
checked against its check."""

BULK: dict[str, Callable[["Block", int], np.ndarray]] = {}
"""Check name -> its bulk rule (``bulk_rule``)."""

SHARED: set[str] = set()
"""Checks whose bulk rule reads nothing but the rank's own views, through ``Block.col`` and
``Block.arrays`` (``bulk_rule(name, shared=True)``): its answer depends on those arrays alone."""

BULK_SKIP: dict[str, Callable[["Block", int], list]] = {}
"""Check name -> its bulk skip rule (``bulk_skip``)."""


def bulk_rule(name: str, *, shared: bool = False):
    """Register the decorated ``fn(block, rank) -> bool[len(block)]`` as check ``name``'s bulk
    rule (see the module doc); ``shared``: see ``SHARED``."""
    def deco(fn):
        BULK[name] = fn
        if shared:
            SHARED.add(name)
        return fn
    return deco


def bulk_skip(name: str):
    """Register the decorated ``fn(block, rank) -> [reason or None per step]`` as check
    ``name``'s skip rule: a reason where the check surely raises ``Skip(reason)`` before reading
    anything that could fail (counted as that skip, not run)."""
    def deco(fn):
        BULK_SKIP[name] = fn
        return fn
    return deco


def bulk_mode() -> str:
    """``on``, ``off``, ``always`` or ``verify`` from ``$PCPVIZ_BULK``."""
    v = os.environ.get(BULK_ENV, "").strip().lower()
    return "off" if v in ("0", "off", "no") else v if v in ("verify", "always") else "on"


class Column:
    """One view of every step of a block on one rank: ``values`` (int64, each step's array
    flattened, concatenated), ``offsets`` int64[n + 1], ``lens`` int64[n] (elements),
    ``present`` bool[n] (absent: length 0), ``ndim`` (the same for every step) and ``rows``
    int64[n] (``shape[0]``), ``dims`` int64[n, ndim] (each step's shape, zeros where absent),
    ``kind`` (the dtype's: ``i``, ``u`` or ``b``)."""

    __slots__ = ("values", "offsets", "lens", "present", "ndim", "rows", "kind", "dims")

    def __init__(self, values: np.ndarray, lens: np.ndarray, present: np.ndarray, ndim: int = 1,
                 dims: np.ndarray | None = None, kind: str = "i"):
        self.values, self.lens, self.present, self.ndim, self.kind = values, lens, present, ndim, kind
        self.dims = lens[:, None] if dims is None else dims
        self.rows = self.dims[:, 0]
        self.offsets = np.zeros(lens.shape[0] + 1, dtype=np.int64)
        np.cumsum(lens, out=self.offsets[1:])

    @classmethod
    def of(cls, arrays: Sequence[Any]) -> "Column | None":
        """The column of ``arrays`` (None where a step lacks the view); None unless every
        present array is an integer (or bool) array of one dtype, not uint64, and one number of
        axes, 1 to 3 (the checks then read it as is, and int64 holds its values); a view absent
        on every step gives a column present nowhere."""
        try:  # each present array's (type, dtype, axes), in one pass
            sig = {(type(a), a.dtype, a.ndim) for a in arrays if a is not None}
        except AttributeError:  # not an array
            return None
        if not sig:  # absent on every step
            zeros = np.zeros(len(arrays), dtype=np.int64)
            return cls(np.zeros(0, dtype=np.int64), zeros, zeros.astype(bool))
        if len(sig) > 1:  # another type, dtype or number of axes somewhere
            return None
        ((kind, dtype, ndim),) = sig
        if kind is not np.ndarray or ndim not in (1, 2, 3) or dtype.kind not in "iub" or dtype == np.uint64:
            return None
        present_list = [a is not None for a in arrays]
        parts = arrays
        if not all(present_list):
            empty = np.zeros((0,) * ndim, dtype=dtype)
            parts = [empty if a is None else a for a in arrays]
        present = np.array(present_list, dtype=bool)
        if ndim == 1:
            lens = np.array(list(map(len, parts)), dtype=np.int64)
            dims = lens[:, None]
        else:
            dims = np.array([p.shape for p in parts], dtype=np.int64).reshape(len(parts), ndim)
            lens = dims.prod(axis=1)
            parts = [p.reshape(-1) for p in parts]
        values = np.concatenate(parts).astype(np.int64, copy=False)
        return cls(values, lens, present, ndim, dims, dtype.kind)

    def one_group(self) -> np.ndarray:
        """bool[n]: present, and one group as ``shapes.slot_groups`` reads it (1-D, or 2-D of
        one row): element ``k`` of the step is then the group's ``k``-th value."""
        return self.present & ((self.rows == 1) if self.ndim == 2 else self.ndim == 1)

    def at(self, step_idx: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, ok): element ``k`` of step ``step_idx`` (elementwise); ``ok`` False where
        ``k`` is outside ``0 .. len - 1`` (its value then 0)."""
        lens = self.lens[step_idx]
        ok = (k >= 0) & (k < lens)
        idx = np.where(ok, self.offsets[step_idx] + k, 0)
        vals = self.values[idx] if self.values.shape[0] else np.zeros(idx.shape[0], np.int64)
        return np.where(ok, vals, 0), ok


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(step, k) of every element of steps holding ``counts`` elements each:
    ``ragged(np.array([2, 0, 1]))`` is ``([0, 0, 2], [0, 1, 0])``."""
    counts = np.maximum(counts, 0)
    seg = np.repeat(np.arange(counts.shape[0]), counts)
    starts = np.cumsum(counts) - counts
    return seg, np.arange(seg.shape[0]) - starts[seg]


def all_per_step(good: np.ndarray, seg: np.ndarray, n: int) -> np.ndarray:
    """bool[n]: every element of each step is good (a step without elements: True)."""
    return np.bincount(seg[~good], minlength=n)[:n] == 0


_NO_VIEWS: dict = {}  # read only: the views of a phase a step lacks


class Block:
    """A run of consecutive steps' records (``StepView``) and their columns, per rank."""

    def __init__(self, svs: Sequence[Any], run_meta: Any):
        self.svs, self.run_meta = list(svs), run_meta
        self._cols: dict[tuple, Column | None] = {}
        self._maps: dict[tuple, list] = {}  # (rank, phase) -> each step's views (None: not recorded)
        self._arrays: dict[tuple, list] = {}  # (rank, phase, view) -> ``arrays``' answer
        self.reads: set | None = None  # (rank, phase, view) read while a shared rule runs
        self.memo: dict = {}  # rank-independent results of the rules' helpers (``gathered``)

    def __len__(self) -> int:
        return len(self.svs)

    def has_rank(self, rank: int) -> np.ndarray:
        """bool[n]: the rank recorded the step."""
        key = ("has_rank", rank)
        if key not in self.memo:
            self.memo[key] = np.fromiter((rank in sv.recs for sv in self.svs), dtype=bool, count=len(self.svs))
        return self.memo[key]

    def arrays(self, rank: int, phase: str, view: str) -> list:
        """The view's array of each step (None where not recorded)."""
        if self.reads is not None:
            self.reads.add((rank, phase, view))
        key = (rank, phase, view)
        got = self._arrays.get(key)
        if got is None:
            maps = self._maps.get((rank, phase))
            if maps is None:  # a step without the phase reads as no views
                maps = self._maps[(rank, phase)] = [_NO_VIEWS if rec is None else getattr(rec, "views", rec) for rec in
                                                    (sv.recs.get(rank, {}).get(phase) for sv in self.svs)]
            got = self._arrays[key] = [m.get(view) for m in maps]
        return list(got)

    def same_reads(self, reads: set, rank: int, other: int) -> bool:
        """Every view ``rank`` read (``reads``) is, on every step, the very array ``other``
        records (or missing on both), and ``rank`` read no other rank's."""
        for r, phase, view in reads:
            if r != rank:
                return False
            if not all(map(is_, self.arrays(rank, phase, view), self.arrays(other, phase, view))):
                return False
        return True

    def col(self, rank: int, phase: str, view: str, *, ndim: int | None = 1,
            bools: bool = False) -> Column | None:
        """The view's column on ``rank``: None where ``Column.of`` gives none, its arrays have
        other than ``ndim`` axes (None: any of 1 to 3), or are bool and ``bools`` is False (a bool array
        indexes as a mask)."""
        key = (rank, phase, view)
        if self.reads is not None:
            self.reads.add(key)
        if key not in self._cols:
            self._cols[key] = Column.of(self.arrays(rank, phase, view))
        col = self._cols[key]
        if col is None or ndim not in (None, col.ndim) or (col.kind == "b" and not bools):
            return None
        return col

    def cols(self, rank: int, phase: str, *views: str) -> list[Column] | None:
        """Several 1-D columns of one phase, or None when one of them is none."""
        out = [self.col(rank, phase, v) for v in views]
        return None if any(c is None for c in out) else out


class _NoStep:
    """A step no rank recorded (a ``Block.previous`` entry without a previous step)."""

    recs: dict = {}
    cache: dict = {}


def previous(block: Block, rank: int) -> Block:
    """The block of each step's previous step as a check on ``rank`` sees it (``Ctx.prev``:
    none after a warm-up step, a malformed step or a step the rank lacks); made once per block
    and rank (the rules that look back share it, and its columns)."""
    key = ("previous", rank)
    if key not in block.memo:
        block.memo[key] = _previous(block, rank)
    return block.memo[key]


def _previous(block: Block, rank: int) -> Block:
    prevs = []
    for sv in block.svs:
        pv = Ctx(block.run_meta, sv, rank, "")._prev_view() if rank in sv.recs else None
        prevs.append(_NoStep() if pv is None else pv)
    return Block(prevs, block.run_meta)


def matched_rows(block: Block, prev: Block, rank: int) -> list[np.ndarray | None]:
    """Per step, each request row's row in the previous step by request id (-1: none; the last
    row of an id recorded twice), as ``positions_consistent`` and ``drafts_fed_back`` match
    them; None where either step lacks req_ids."""
    out: list[np.ndarray | None] = []
    for rid, prid in zip(block.arrays(rank, "target", "req_ids"), prev.arrays(rank, "target", "req_ids")):
        if rid is None or prid is None:
            out.append(None)
            continue
        prow = {str(x): i for i, x in enumerate(prid.tolist())}
        out.append(np.array([prow.get(str(x), -1) for x in rid.tolist()], dtype=np.int64))
    return out


def decide(block: Block, names: Sequence[str], ranks: Sequence[int]) -> list[dict[str, dict[int, Any]]]:
    """Per step of the block: check name -> rank -> True (the bulk rule says it passes) or a
    skip reason (the skip rule's), ``decide_arrays``' answer step by step."""
    sure, skips = decide_arrays(block, names, ranks)
    out: list[dict[str, dict[int, Any]]] = [{} for _ in range(len(block))]
    for (name, r), ok in sure.items():
        for i in np.flatnonzero(ok).tolist():
            out[i].setdefault(name, {})[r] = True
    for (i, r), reasons in skips.items():
        for name, why in reasons.items():
            out[i].setdefault(name, {})[r] = why
    return out


def decide_arrays(block: Block, names: Sequence[str],
                  ranks: Sequence[int]) -> tuple[dict[tuple[str, int], np.ndarray], dict[tuple[int, int], dict]]:
    """(sure, skips): ``sure[(name, rank)]`` bool[n], True on the steps the rank recorded where
    check ``name``'s bulk rule says it passes (a rule that raises decides nothing) and its skip
    rule gives no reason; ``skips[(i, rank)]``: check name -> the skip rule's reason at step
    ``i`` of the block. A ``shared`` rule's answer on a rank whose reads give the very arrays
    another rank's did is that rank's (the reader shares a byte-equal payload: a global view is
    judged once, not once a rank). A rule passing steps 0 and 2 of three on rank 1:
    ``sure[("ranks_agree", 1)]`` is ``[True, False, True]``."""
    sure: dict[tuple[str, int], np.ndarray] = {}
    skips: dict[tuple[int, int], dict] = {}
    for name in names:
        done: list[tuple[int, set, np.ndarray]] = []  # a shared rule's (rank, reads, answer)
        for r in ranks:
            has = block.has_rank(r)
            skipped = _skips(block, name, r, has, skips) if name in BULK_SKIP else None
            if name not in BULK:
                continue
            ok = next((res for r0, reads, res in done if block.same_reads(reads, r0, r)), None)
            if ok is None:
                block.reads = set()
                try:
                    ok = np.asarray(BULK[name](block, r), dtype=bool)
                except Exception:  # noqa: BLE001 - undecided: the per-step code judges
                    ok = None
                if ok is not None and name in SHARED and len(done) < 4:
                    done.append((r, block.reads, ok))
                block.reads = None
            if ok is not None and ok.shape == (len(block),):
                sure[(name, r)] = ok & has if skipped is None else ok & has & ~skipped
    return sure, skips


def _skips(block: Block, name: str, rank: int, has: np.ndarray, skips: dict) -> np.ndarray | None:
    """bool[n]: where the skip rule gives a reason (put into ``skips``); None if it raises."""
    try:
        reasons = list(BULK_SKIP[name](block, rank))
    except Exception:  # noqa: BLE001 - undecided: the per-step code judges
        return None
    given = np.zeros(len(block), dtype=bool)
    for i in [i for i, why in enumerate(reasons[:len(block)]) if why is not None]:  # most steps give none
        if has[i]:
            skips.setdefault((i, rank), {})[name] = str(reasons[i])
            given[i] = True
    return given


def same_values(x: np.ndarray, y: np.ndarray) -> bool:
    """Two arrays of one shape that ``first_difference`` finds equal, told without it: integers
    (or bools) of equal values, strings both, or tables of one dtype of integer fields."""
    if x.shape != y.shape:
        return False
    if x.dtype.names is None and y.dtype.names is None:
        if not ((x.dtype.kind in "iub" and y.dtype.kind in "iub") or x.dtype.kind == y.dtype.kind == "U"):
            return False
        if x.dtype == y.dtype and x.dtype.kind in "iuU":  # one dtype: equal bytes are equal values
            return x.tobytes() == y.tobytes()  # (else False: always safe; a tenth of np.array_equal's cost)
        return bool(np.array_equal(x, y))
    if x.dtype != y.dtype or any(x.dtype[f].kind not in "iu" for f in x.dtype.names):
        return False
    return x.tobytes() == y.tobytes() or all(np.array_equal(x[f], y[f]) for f in x.dtype.names)


def none(block: Block) -> np.ndarray:
    """bool[n] all False: a rule that decides nothing on this block."""
    return np.zeros(len(block), dtype=bool)


def step_sums(col: Column) -> np.ndarray:
    """int64[n]: the sum of each step's values (0 where absent)."""
    cs = np.zeros(col.values.shape[0] + 1, dtype=np.int64)
    np.cumsum(col.values, out=cs[1:])
    return cs[col.offsets[1:]] - cs[col.offsets[:-1]]


def rank_rows(block: Block, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, Column] | None:
    """``Ctx.padded``, ``Ctx.num_local`` and the column ``Ctx.rank_rows`` slices, per step:
    (ok bool[n], P int64[n], n int64[n], padded_gather_idx), ``ok`` where they are what the
    per-step code computes without failing (run.json's pcp set, padded_gather_idx and
    per_rank_num_tokens recorded, ``0 <= n <= P``); None when the block gives no columns."""
    world = block.run_meta.pcp
    pgi = block.col(rank, "target", "padded_gather_idx")
    prn = block.col(rank, "target", "per_rank_num_tokens")
    if not world or world < 1 or pgi is None or prn is None or not 0 <= rank < world:
        return None
    p = pgi.lens // world
    n, has = prn.at(np.arange(len(block)), np.full(len(block), rank))
    ok = pgi.present & prn.present & (pgi.lens % world == 0) & has & (n >= 0) & (n <= p)
    return ok, p, n, pgi


def starts(col: Column) -> np.ndarray:
    """int64[len(values)]: each element's exclusive running sum within its step (a
    ``query_start_loc`` of each step's counts, without its last entry)."""
    cs = np.zeros(col.values.shape[0] + 1, dtype=np.int64)
    np.cumsum(col.values, out=cs[1:])
    seg = np.repeat(np.arange(col.lens.shape[0]), col.lens)
    return cs[:-1] - cs[col.offsets[:-1]][seg]


def gathered(block: Block, phase: str, view: str) -> tuple[np.ndarray, np.ndarray, Callable] | None:
    """The all-gather of a 1-D view over ranks ``0 .. pcp - 1`` (rank-major, as the checks'
    ``_gathered``), per step: (ok bool[n], length int64[n], ``at(step, j) -> (values, ok)``),
    ``ok`` where every rank recorded it with one length; None without run.json's pcp."""
    key = ("gathered", phase, view)
    if key not in block.memo:
        block.memo[key] = _gathered(block, phase, view)
    return block.memo[key]


def _gathered(block: Block, phase: str, view: str) -> tuple[np.ndarray, np.ndarray, Callable] | None:
    world = block.run_meta.pcp
    if not world or world < 1:
        return None
    cols = [block.col(r, phase, view) for r in range(world)]
    if any(c is None for c in cols):
        return None
    ok = np.ones(len(block), dtype=bool)
    for c in cols:
        ok &= c.present & (c.lens == cols[0].lens)
    each = cols[0].lens

    def at(step: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        width = np.maximum(each[step], 1)
        r, k = j // width, j % width
        vals, good = np.zeros(j.shape[0], dtype=np.int64), (j >= 0) & (j < each[step] * world)
        for i, c in enumerate(cols):
            sel = good & (r == i)
            vals[sel], got = c.at(step[sel], k[sel])
            good[sel] &= got
        return vals, good

    return ok, each * world, at
