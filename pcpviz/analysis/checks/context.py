"""What a check sees: the per-(step, rank) context ``Ctx`` (views, derived quantities such as
P, the rank's rows and slots, and the verdicts ``fail``/``expect``; ``run_meta``: run.json as
``pcpviz.trace.meta_model.RunMeta``, less the keys ``validate`` found wrong), and the registry
the ``@check`` decorator fills (in definition order).
A check raises ``Skip`` when an input view was not recorded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from pcpviz.reference.batch import query_start_loc
from pcpviz.reference.blocks import compute_slot_mappings
from pcpviz.analysis.compare import first_difference, short_repr
from pcpviz.trace import SEGMENT_DTYPE, draft_index
from pcpviz.trace.meta_model import RunMeta
from pcpviz.trace.schema import int_view, view_spec

from .declared import validate_check


class Skip(Exception):
    """An input view or phase was not recorded: the check does not run on this (step, rank)."""


class Fail(Exception):
    def __init__(self, violation_kwargs: dict[str, Any]):
        super().__init__(violation_kwargs.get("message", ""))
        self.kw = violation_kwargs


def _is_warmup(phases: Mapping[str, Mapping[str, np.ndarray]]) -> bool:
    """A step vLLM ran while warming up (``target`` view ``warmup``; recorded only with
    ``PCPVIZ_RECORD_DUMMY=1``): synthetic requests with made-up draft tokens."""
    w = phases.get("target", {}).get("warmup")
    return w is not None and bool(np.asarray(w).any())


class StepView:
    """One step's records on every rank (``recs[rank][phase]``) and the previous step's."""

    def __init__(self, step: int, recs: dict[int, dict[str, Mapping[str, np.ndarray]]],
                 prev: "StepView | None", missing: tuple[int, ...]):
        self.step = step
        self.recs = recs
        self.prev = prev
        self.missing = missing  # ranks lacking this step although they recorded later steps
        self.cache: dict[Any, Any] = {}


class StepFold(Protocol):
    """A question ``run_checks`` answers over every step in the pass its checks make (``folds=``),
    from the records it has decoded already: ``start()`` a state, ``add(state, step_view)`` for each
    step in step order (the records of every rank that has it: ``step_view.recs[rank][phase]``), and
    ``merge(states)`` of consecutive runs' states, in step order, the answer. The steps may be cut
    into runs checked in forked processes: ``add`` must be a pure function of the state and the
    step, a state picklable, and ``merge`` give what one ``add`` after another would. E.g.
    ``pcpviz.analysis.acceptance.AcceptanceFold`` (each rank's acceptance)."""

    def start(self) -> Any: ...

    def add(self, state: Any, sv: StepView) -> Any: ...

    def merge(self, states: list[Any]) -> Any: ...


class Ctx:
    """What a check sees for one (step, rank).

    Every read goes through ``get``/``need``/``has``/``draft_phases``/``prev`` and is logged; a
    check that reads ``rank``, ``phases`` or ``sv`` itself is marked rank-dependent. A check that
    passed (or was skipped) on one rank without being rank-dependent has the same outcome on
    every rank whose reads give the very same arrays (``replays``): the reader hands every rank
    one array for a payload they recorded byte-equal, so the runner checks a global view once
    a step, not once a rank."""

    def __init__(self, run_meta: RunMeta, sv: StepView, rank: int, check: str, *, log: list | None = None,
                 offset: int = 0, root: "Ctx | None" = None):
        self.run_meta, self._sv, self._rank, self.check = run_meta, sv, rank, check
        self._phases = sv.recs[rank]
        self._log: list = [] if log is None else log  # what was read: see ``replays``
        self._offset = offset  # 0: this step, 1: the previous one
        self.local = False  # read the rank, its phases or the step view directly
        self._root = self if root is None else root  # the check's own context (prev()'s parent)

    @property
    def step(self) -> int:
        return self._sv.step

    @property
    def rank(self) -> int:
        self._root.local = True
        return self._rank

    @property
    def phases(self) -> Mapping[str, Mapping[str, np.ndarray]]:
        self._root.local = True
        return self._phases

    @property
    def sv(self) -> StepView:
        self._root.local = True
        return self._sv

    @property
    def cache(self) -> dict:
        """The step's memo of rank-independent results (keys name their inputs)."""
        return self._sv.cache

    # -- reading views
    def has(self, phase: str) -> bool:
        present = phase in self._phases
        self._log.append(("p", self._offset, phase, present))
        return present

    def _read(self, phase: str, view: str):
        rec = self._phases.get(phase)
        views = getattr(rec, "views", rec)  # a Record's mapping (its [] explains a miss: slow)
        value = None if views is None else views.get(view)
        self._log.append(("v", self._offset, phase, view, value))
        return rec, value

    def get(self, phase: str, view: str) -> np.ndarray | None:
        _, value = self._read(phase, view)
        return None if value is None else _checked(phase, view, value)

    def need(self, phase: str, view: str) -> np.ndarray:
        rec, value = self._read(phase, view)
        if rec is None:
            raise Skip(f"no {phase} phase")
        if value is None:
            raise Skip(f"no {view}")
        return _checked(phase, view, value)

    def t(self, view: str) -> np.ndarray:
        return self.need("target", view)

    def rank_view(self, rank: int, phase: str, view: str) -> np.ndarray | None:
        """``view`` of ``phase`` as rank ``rank`` recorded it this step (None if it did not): the
        same answer whichever rank's check asks."""
        rec = self._sv.recs.get(rank, {}).get(phase)
        return None if rec is None or view not in rec else _checked(phase, view, rec[view])

    def once(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, run once a step for every rank it reads the same arrays on (``replays``):
        the rank-independent part of a check that also reads rank-local views. Only a normal
        return is remembered; a ``Fail`` or ``Skip`` is raised again on each rank."""
        entries = self._sv.cache.setdefault(("once", name), [])
        for log, result in entries:
            if self.replays(log):
                self._log.extend(log)
                return result
        outer, outer_local = self._log, self.local
        self._log, self.local = [], False
        try:
            result = fn()
        finally:
            sub, sub_local = self._log, self.local
            self._log, self.local = outer, outer_local or sub_local
            outer.extend(sub)
        if not sub_local and len(entries) < 2:
            entries.append((sub, result))
        return result

    def draft_phases(self, first: int = 0) -> list[tuple[int, str]]:
        out = [(draft_index(p), p) for p in self._phases if draft_index(p) is not None]
        out = sorted((k, p) for k, p in out if k >= first)
        self._log.append(("d", self._offset, first, tuple(out)))
        return out

    def _prev_view(self) -> "StepView | None":
        pv = self._sv.prev
        if pv is None or self._rank not in pv.recs:
            return None
        if _is_warmup(pv.recs[self._rank]) or _is_warmup(self._phases):
            return None  # vLLM's synthetic warm-up steps do not continue into serving
        if pv.cache.get(("bounds", self._rank)):
            return None  # a malformed previous step gives nothing to compare with
        return pv

    def prev(self) -> "Ctx | None":
        if self._offset:
            raise ValueError("a check looks one step back at most")
        pv = self._prev_view()
        self._log.append(("prev", pv is not None))
        if pv is None:
            return None
        return Ctx(self.run_meta, pv, self._rank, self.check, log=self._log, offset=1, root=self._root)

    def replays(self, log: list) -> bool:
        """True if every read in ``log`` (another rank's, this check, this step) gives this rank
        the same answer: the same array objects, the same phases present."""
        recs = (self._phases, None)
        for entry in log:
            kind = entry[0]
            if kind == "prev":
                pv = self._prev_view()
                if (pv is not None) != entry[1]:
                    return False
                recs = (self._phases, None if pv is None else pv.recs[self._rank])
                continue
            phases = recs[entry[1]]
            if kind == "v":
                views = getattr(phases.get(entry[2]), "views", phases.get(entry[2]))
                if (None if views is None else views.get(entry[3])) is not entry[4]:
                    return False
            elif kind == "p":
                if (entry[2] in phases) != entry[3]:
                    return False
            elif kind == "d":
                out = [(draft_index(p), p) for p in phases if draft_index(p) is not None]
                if tuple(sorted((k, p) for k, p in out if k >= entry[2])) != entry[3]:
                    return False
        return True

    # -- derived quantities (cached per step where they are rank-independent)
    def pcp(self) -> int:
        if self.run_meta.pcp:
            return self.run_meta.pcp
        prn = self.get("target", "per_rank_num_tokens")
        if prn is not None:
            return int(prn.shape[0])
        return max(self._sv.recs) + 1

    def shard(self) -> bool:
        if self.run_meta.shard_decode_requests is not None:
            return self.run_meta.shard_decode_requests
        return self.pcp() > 1 and self.run_meta.dcp == 1

    def num_reqs(self) -> int:
        for view in ("num_scheduled_tokens", "req_ids", "seq_lens", "is_prefilling"):
            v = self.get("target", view)
            if v is not None:
                return int(v.shape[0])
        v = self.get("verify", "num_sampled")
        if v is not None:
            return int(v.shape[0])
        raise Skip("no num_scheduled_tokens")

    def qsl(self) -> np.ndarray:
        """int64[R+1] from num_scheduled_tokens (or the recorded query_start_loc)."""
        q = self.get("target", "num_scheduled_tokens")
        if q is not None:
            return query_start_loc(q)
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
        raise Skip("no padded_gather_idx")

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
        raise Skip("no per_rank_num_tokens")

    def rank_rows(self) -> np.ndarray:
        """int64[n]: global token of each real local row of this rank."""
        pgi = self.t("padded_gather_idx")
        p, n = self.padded(), self.num_local()
        return pgi[self.rank * p:self.rank * p + n].astype(np.int64)

    def dcp_rank(self) -> int:
        """This rank's DCP rank: its PCP rank when the DCP group is the PCP group (run.json
        ``dcp_group`` 'pcp'), else run.json's ``dcp_rank``."""
        return self.rank % self.run_meta.dcp if self.run_meta.dcp_group == "pcp" else self.run_meta.dcp_rank

    def block_sizes(self, groups: int) -> list[int]:
        bs = self.run_meta.kv_block_sizes
        if bs is None:
            raise Skip("no block_size in run.json")
        if len(bs) == 1:
            return list(bs) * groups
        if len(bs) != groups:
            raise Skip(f"run.json has {len(bs)} block sizes for {groups} KV-cache groups")
        return list(bs)

    def slots(self, table: np.ndarray, qsl: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """int64[G, T]: slots of rows ``arange(R)`` of a global-order table [G, R, W] (DCP
        settings from run.json). Block indices past the table's width read the null block 0,
        as a zero-padded vLLM table would; ``no_null_block`` then reports them."""
        sizes = self.block_sizes(table.shape[0])
        kw = {}
        if self.run_meta.dcp > 1:
            kw = dict(cp_size=self.run_meta.dcp, cp_rank=self.dcp_rank(),
                      cp_interleave=self.run_meta.dcp_interleave)
        rows = np.arange(table.shape[1], dtype=np.int64)
        out = []
        null_table = np.zeros((table.shape[1], 1), table.dtype)
        for g in range(table.shape[0]):
            span = sizes[g] * self.run_meta.dcp
            # a block past the table's width reads the null block 0: such a token gets the slot
            # a one-column zero table gives for its offset (no table padded to the position)
            past = positions // span >= table.shape[2]
            tg = table[g] if table.shape[2] else null_table
            slots = compute_slot_mappings(tg, sizes[g], rows, query_start_loc=qsl,
                                          positions=np.where(past, 0, positions), **kw)[0]
            if past.any():
                null = compute_slot_mappings(null_table, sizes[g], rows, query_start_loc=qsl,
                                             positions=positions % span, **kw)[0]
                if null.shape != past.shape:
                    raise ValueError(f"{positions.shape[0]} positions for {null.shape[0]} scheduled tokens")
                slots = np.where(past, null, slots)
            out.append(slots)
        return np.stack(out) if out else np.zeros((0, int(qsl[-1])), dtype=np.int64)

    def no_null_block(self, phase: str, view: str, *, want: np.ndarray, got: np.ndarray,
                      positions: np.ndarray) -> None:
        """Fail if a KV write lands in the null block 0 (never allocated to a request): ``want``
        the slots expected (int64[G, T]), ``got`` the recorded ones, ``positions`` int64[T]."""
        expected, actual = want, got
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
        raise Fail(dict(check=self.check, step=self.step, rank=self._rank if rank is None else rank,
                         phase=phase, view=view, message=message,
                         index=None if index is None else tuple(int(i) for i in index),
                         expected=expected, actual=actual))

    def expect(self, phase: str, view: str, *, want: Any, got: Any, what: str = "",
               index_map: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None,
               rank: int | None = None) -> None:
        """Fail unless ``got`` (what ``phase``'s ``view`` holds) equals ``want`` exactly:
        ``c.expect("target", "positions", want=[0, 1, 2], got=pos, what="not contiguous")``.
        ``index_map`` translates an index into the compared arrays to one into the recorded
        view (for masked comparisons)."""
        expected, actual = want, got
        differs, idx, reason = first_difference(expected, actual)
        if not differs:
            return
        if idx is None:
            self.fail(phase, view, f"{what + ': ' if what else ''}{reason}",
                      expected=short_repr(expected), actual=short_repr(actual), rank=rank)
        shown = index_map(idx) if index_map is not None else idx
        self.fail(phase, view, what or "values differ", index=shown,
                  expected=short_repr(expected, idx), actual=short_repr(actual, idx), rank=rank)


def token_rows(qsl: np.ndarray) -> np.ndarray:
    """int64[T]: request row of every global token."""
    return np.repeat(np.arange(qsl.shape[0] - 1, dtype=np.int64), np.diff(qsl))


def segments_of(ctx: Ctx) -> np.ndarray:
    segs = ctx.t("segments")
    if segs.dtype.names is None or not set(SEGMENT_DTYPE.names) <= set(segs.dtype.names):
        ctx.fail("target", "segments", f"not a segments table (fields {segs.dtype.names}, "
                 f"expected {SEGMENT_DTYPE.names})")
    return segs


def segment_rows(segs: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(gathered row, segment index) of every row covered by the segments table."""
    lens = (segs["local_stop"] - segs["local_start"]).astype(np.int64)
    seg_of = np.repeat(np.arange(segs.shape[0]), lens)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    offset = np.arange(seg_of.shape[0]) - starts
    rows = segs["rank"][seg_of] * p + segs["local_start"][seg_of] + offset
    return rows.astype(np.int64), seg_of


def local_segments(ctx: Ctx) -> tuple[np.ndarray, np.ndarray]:
    """(global request, length) of this rank's local segments, in local order; a rank without
    segments has vLLM's zero-length placeholder row for request 0."""
    segs = segments_of(ctx)
    mine = segs[segs["rank"] == ctx.rank]
    mine = mine[np.argsort(mine["local_start"], kind="stable")]
    if mine.shape[0] == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    return mine["global_req_idx"].astype(np.int64), (mine["local_stop"] - mine["local_start"]).astype(np.int64)


# --------------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class CheckDef:
    name: str
    description: str
    fn: Callable[[Ctx], None]


DEFS: list[CheckDef] = []
_OWN_CHECKS = __name__.rsplit(".", 1)[0] + "."  # pcpviz.analysis.checks.


def check(name: str, description: str):
    """Register the decorated ``fn(ctx)`` as check ``name``; a view name it reads that
    ``pcpviz.trace.schema.VIEW_SPECS`` does not declare fails here, at registration
    (``pcpviz.analysis.checks.declared``). pcpviz's own checks are held to the same rule by
    ``tests/analysis/test_check_views_declared.py`` (every function of their modules) instead:
    parsing their source at every command's start cost 50-130 ms of a one-second ``check``."""
    def deco(fn):
        if not getattr(fn, "__module__", "").startswith(_OWN_CHECKS):
            validate_check(name, fn)
        DEFS.append(CheckDef(name, description, fn))
        return fn
    return deco


def _checked(phase: str, view: str, value):
    """A view as the checks read it: a view the schema declares integer but a file stored as
    floats is kept when it holds whole numbers, and NaN, inf or 2.5 raise ValueError naming the
    view (the check then reports it could not evaluate) instead of becoming garbage integers."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        spec = view_spec(phase, view) if isinstance(view, str) else None
        if spec is not None and spec.dtype.startswith(("int", "uint")):
            return int_view(value, f"{phase}.{view}")
    return value
