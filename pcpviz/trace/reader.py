"""Lazy trace reader: ``open(run_dir) -> Trace``.

Open reads ``run.json``, then memory-maps each ``rank<N>.arrow`` and walks its record batches
(``index.scan_rank_file``). Arrow reads a batch from a memory map without copying, so the walk
touches only the message headers and the small columns (step, phase, view, dtype, shape, crc32)
that it validates; it keeps per step only its number, its message's byte range and its row
layout (a few MB for 100,000 steps). The payloads stay on disk until ``record()`` asks for them;
decoded records are kept in a bounded LRU cache, and the mapped pages read are handed back to
the kernel every 256 MB read (``index.MapBudget``, all rank files together): a pass over every step holds a
bounded part of the file in memory, however many steps it has.

A row decodes to a read-only view of its batch's payload bytes (``batches.Loaded.u8``; the
shapes of a batch are parsed once, a row's crc32 continues from the step's head crc32).
``lazy_record`` checks every row's crc32 of a record as ``record`` does but decodes a view only
when it is read: the Chrome export reads a handful of counts of each record.

Ranks that record a payload byte-equal (a global view) get one array for it: a payload with the
same row identity and crc32 as one another rank decoded in the same step is compared byte for
byte with it, which checks it as its crc32 would (equal bytes under an equal row head), and the
checks then judge the array once, not once a rank (``pcpviz.analysis.checks.context``).

Policy on damage (the design's "loses nothing"):

* What identifies the run or a file is checked strictly and always raises ``TraceError``:
  no/unparseable run.json, a newer schema version, a foreign file, a rank file whose metadata
  names another rank, unexpected columns.
* A step that Arrow parses but whose content is wrong (duplicate or decreasing step, bad phase or
  view name, dtype not understood, size not matching its shape) also raises: that is a producer
  bug, never a crash artefact, and hiding it would mislead.
* Bytes Arrow cannot parse at the end of a file (a writer killed mid-step, a truncated copy) or
  in its middle (corruption) end the rank's readable steps: every step before them is kept, and
  a one-line note naming the file and the last complete step goes to ``Trace.warnings`` and to
  ``warnings.warn``. ``strict=True`` raises ``TraceError`` instead.
* A payload whose bytes were damaged fails its crc32 when decoded: ``record()`` raises
  ``TraceError`` naming file, step, phase and view. ``Trace.verify()`` checks every payload.
"""

from __future__ import annotations

import os
import threading
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import numpy as np

from . import schema as S
from .errors import TraceError, TraceWarning
from .batches import one_line as _one_line, phase_rows, row_plan, same_bytes
from .bounds import rows_clean
from .row_views import LazyViews, decode_row, view_names_of
from .step_rows import decode_step_rows
from .index import MapBudget, RankIndex, scan_rank_files
from .owner import rank_file_busy, writer_busy
from .meta_model import decode_meta
from .runmeta import check_version, file_kind, read_meta
from pcpviz.limits import MAX_WORLD_SIZE

__all__ = ["open", "Trace", "Record", "RankFile", "steps_summary"]



# --------------------------------------------------------------------------- public records

@dataclass(frozen=True, eq=False)
class Record(Mapping[str, np.ndarray]):
    """The views one rank recorded in one phase of one step: ``rec["positions"]``.

    Arrays are read-only (zero-copy views of the mapped file for numeric dtypes). Two records are
    equal when they have the same views with equal dtype kinds, shapes and values.
    """

    step: int
    rank: int
    phase: str
    views: Mapping[str, np.ndarray]
    pcp: int | None = None  # run.json's PCP world size (None when the record's run is not known)

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.views[name]
        except KeyError:
            raise KeyError(f"view {name!r} not recorded at step {self.step}, rank {self.rank}, "
                           f"phase {self.phase!r} (views: {', '.join(self.views) or 'none'})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.views)

    def __len__(self) -> int:
        return len(self.views)

    def __contains__(self, name: object) -> bool:
        return name in self.views

    def get(self, name: str, default: Any = None) -> Any:
        """``rec.get("positions")``: the view, or ``default`` (Mapping's own ``get`` goes through
        ``[]``, whose miss builds a message, then drops it: the checks ask for many views a
        record lacks)."""
        return self.views.get(name, default)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        if set(self.keys()) != set(other.keys()):
            return False
        for name, a in self.items():
            b = np.asarray(other[name])
            if a.shape != b.shape or (a.dtype.kind == "U") != (b.dtype.kind == "U"):
                return False
            if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        views = ", ".join(f"{k}: {v.dtype.str}{list(v.shape)}" for k, v in self.views.items())
        return f"Record(step={self.step}, rank={self.rank}, phase={self.phase!r}, {{{views}}})"


@dataclass(frozen=True)
class RankFile:
    """What open found in one rank file."""

    rank: int
    path: Path
    steps: tuple[int, ...]  # complete steps, increasing
    size: int  # bytes in the file when it was opened
    good_bytes: int  # bytes of complete messages (schema, steps, end-of-stream marker)
    closed: bool  # the writer closed it (end-of-stream marker present)
    finalizes: bool = False  # its writer promised a completion record (``completion.COMPLETION_KEY``)


def steps_summary(steps: list[int] | tuple[int, ...]) -> str:
    """``0-5, 7, 9-12`` for a sorted list of steps."""
    if not steps:
        return "none"
    parts, start, prev = [], steps[0], steps[0]
    for s in list(steps[1:]) + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ", ".join(parts)


# --------------------------------------------------------------------------- the trace

class Trace:
    """A run opened lazily: ``run_meta``, ``steps``, ``ranks``, ``phases()``, ``record()``.

    ``run_meta`` is run.json decoded once (``meta_model.RunMeta``: ``t.run_meta.pcp``,
    ``t.run_meta.kv_block_sizes``); ``meta_malformed`` the ``(key, why)`` of each known key it could
    not decode (``validate`` reports them); ``meta`` the document as read (read-only), for a tool
    of one's own."""

    def __init__(self, path: Path, meta: dict[str, Any], files: dict[int, RankFile],
                 index: dict[int, RankIndex], warnings_: list[str], cache_size: int,
                 unreadable: Mapping[int, str] | None = None):
        self.path = path
        self.meta: Mapping[str, Any] = MappingProxyType(meta)  # read-only: run_meta was decoded from it
        self.run_meta, self.meta_malformed = decode_meta(meta, version=check_version(
            path / S.RUN_META_FILE, meta[S.META_SCHEMA_KEY]))
        # the schema version that wrote the trace: records are read by its rules (schema.upgrade_views)
        self.version: int = self.run_meta.pcpviz_trace_schema
        self.files: Mapping[int, RankFile] = MappingProxyType(files)
        # rank -> one line: rank files that exist but cannot be read (a directory, a device, ...)
        self.unreadable: Mapping[int, str] = MappingProxyType(dict(unreadable or {}))
        self.warnings: list[str] = warnings_
        self._index = index
        budget = MapBudget(list(index.values()))
        for ix in index.values():
            ix.budget = budget  # one budget of mapped bytes for the whole trace
        steps = [ix.steps for ix in index.values()]
        self._steps: list[int] = np.unique(np.concatenate(steps)).tolist() if steps else []
        self._cache: OrderedDict[tuple[int, int, str], Record] = OrderedDict()
        self._cache_size = max(0, int(cache_size))
        self._lock = threading.Lock()
        self._shared: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # this step's big rows, verified
        self._shared_step: int | None = None
        self._pcp = self.run_meta.pcp
        self._anywhere: dict[str, frozenset[str]] = {}  # phase -> ``views_anywhere``

    @property
    def steps(self) -> list[int]:
        """Steps complete on at least one rank, sorted."""
        return list(self._steps)

    @property
    def ranks(self) -> list[int]:
        """Ranks with a file in the run directory, sorted."""
        return sorted(self.files)

    def rank_steps(self, rank: int) -> list[int]:
        """Steps complete on ``rank``."""
        return list(self._file(rank).steps)

    def phases(self, step: int, rank: int) -> list[str]:
        """Phases recorded at ``step`` on ``rank``, in execution order."""
        ix, i = self._entry(step, rank)
        return list(ix.layouts[i].phases)

    def has(self, step: int, rank: int, phase: str) -> bool:
        try:
            ix = self._index.get(rank)
        except TypeError:  # unhashable
            ix = None
        i = None if ix is None else ix.find(step)
        return i is not None and phase in ix.layouts[i].phases

    def step_bytes(self, step: int, rank: int) -> int:
        """Bytes of the record batch of ``step`` on ``rank`` in its file, as the index says (its
        payloads and their index): what reading the step costs, known without reading it."""
        ix, i = self._entry(step, rank)
        return int(ix.ends[i]) - int(ix.starts[i])

    def view_names(self, step: int, rank: int, phase: str) -> frozenset[str]:
        """The names of the views ``phase`` recorded at ``step`` on ``rank``, read from the step's
        index (no payload read, no crc32 checked): a pass that wants a view few steps record asks
        this before it decodes a record. ``KeyError`` as ``record()``'s."""
        if self.version < 2:  # schema.upgrade_views renames an old trace's views: decode to know
            return frozenset(self.record(step, rank, phase))
        ix, i = self._phase_entry(step, rank, phase)
        return view_names_of(ix.layouts[i], phase)

    def views_anywhere(self, phase: str) -> frozenset[str]:
        """The names of the views ``phase`` records at some step on some rank, read from the steps'
        index (each distinct layout once): a pass after a view no step records need not start."""
        got = self._anywhere.get(phase)
        if got is None:  # (an old trace's names as schema.upgrade_views renames them: one record a layout)
            got = self._anywhere[phase] = frozenset().union(
                *(self.view_names(step, rank, phase) for layout, rank, step in self._distinct_layouts()
                  if phase in layout.phases))
        return got

    def _distinct_layouts(self) -> list[tuple[Any, int, int]]:
        """(layout, a rank and step recording it) of each distinct step layout."""
        seen: dict[int, tuple[Any, int, int]] = {}
        for rank, ix in self._index.items():
            for i, layout in enumerate(ix.layouts):
                if id(layout) not in seen:
                    seen[id(layout)] = (layout, rank, int(ix.steps[i]))
        return list(seen.values())

    def view_shape(self, step: int, rank: int, phase: str, *, view: str) -> tuple[int, ...] | None:
        """The shape ``view`` of ``phase`` has at ``step`` on ``rank`` as the step's index says (no
        payload read; the array ``record()`` decodes has it), None where the phase lacks the view.
        ``KeyError`` as ``record()``'s."""
        if self.version < 2:  # schema.upgrade_views may reshape an old trace's views: decode to know
            rec = self.record(step, rank, phase)
            return tuple(np.asarray(rec[view]).shape) if view in rec else None
        ix, i = self._phase_entry(step, rank, phase)
        j = phase_rows(ix.layouts[i], phase).get(view)
        return None if j is None else ix.shapes[i][j]

    def record(self, step: int, rank: int, phase: str) -> Record:
        """The views of ``phase`` at ``step`` on ``rank``, decoded on first use (then cached)."""
        key = (step, rank, phase)
        with self._lock:
            rec = self._cache.get(key)
            if rec is not None:
                self._cache.move_to_end(key)
                return rec
        ix, i = self._phase_entry(step, rank, phase)
        views = S.upgrade_views(self.version, phase, self._decode(ix, i, phase, share=True))
        rec = Record(int(step), int(rank), phase, MappingProxyType(dict(views)), pcp=self._pcp)
        with self._lock:
            self._cache[key] = rec
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return rec

    def lazy_record(self, step: int, rank: int, phase: str, *, check_unread: bool = True) -> Record:
        """``record()`` for a reader that needs a few of the views (the Chrome export's counts):
        every row's crc32 is checked now, as ``record()`` does, but a view is decoded only when
        read (``LazyViews``). Not cached; arrays are not shared between ranks. A version 1
        verify record (``schema.upgrade_views`` rewrites it whole) is ``record()``.
        ``check_unread`` False: a row's crc32 is checked when the row is read, the others' not at
        all, for a pass whose caller reads every row later anyway (``diff``'s look at the
        schedules before it compares the steps): what it reads is never damaged data."""
        if self.version < 2 and phase == S.PHASE_VERIFY:
            return self.record(step, rank, phase)
        ix, i = self._entry(step, rank)
        if phase not in ix.layouts[i].phases:
            return self.record(step, rank, phase)  # raises the KeyError record() raises
        return Record(int(step), int(rank), phase, LazyViews(ix, i, phase, check_unread=check_unread),
                      pcp=self._pcp)

    def verify(self) -> int:
        """Decode every record (checking every crc32); returns how many. Raises TraceError."""
        n = 0
        for rank, ix in sorted(self._index.items()):
            for i in range(ix.steps.shape[0]):
                for phase in ix.layouts[i].phases:
                    self._decode(ix, i, phase, share=False)
                    n += 1
        return n

    def __repr__(self) -> str:
        return (f"Trace({str(self.path)!r}, ranks={self.ranks}, "
                f"steps={steps_summary(self._steps)}, warnings={len(self.warnings)})")

    def _file(self, rank: int) -> RankFile:
        try:
            return self.files[rank]
        except (KeyError, TypeError):
            raise KeyError(f"no rank {rank!r} in {self.path} (ranks: {self.ranks})") from None

    def _entry(self, step: int, rank: int) -> tuple[RankIndex, int]:
        info = self._file(rank)
        ix = self._index[info.rank]
        i = ix.find(step)
        if i is None:
            raise KeyError(f"step {step!r} not recorded on rank {rank} "
                           f"(rank {rank} has steps {steps_summary(info.steps)})")
        return ix, i

    def _phase_entry(self, step: int, rank: int, phase: str) -> tuple[RankIndex, int]:
        """``_entry``, and ``KeyError`` naming the step's phases where it lacks ``phase``."""
        ix, i = self._entry(step, rank)
        if phase not in ix.layouts[i].phases:
            raise KeyError(f"phase {phase!r} not recorded at step {step} on rank {rank} "
                           f"(phases: {', '.join(ix.layouts[i].phases)})")
        return ix, i

    def step_records(self, step: int, rank: int) -> dict[str, Record]:
        """Every phase ``record()`` gives for ``step`` on ``rank``, in execution order, decoded in
        one pass over the step's batch (one index look-up, every row's crc32 checked as
        ``record()`` checks it, arrays shared between ranks as it shares them); not cached: the
        checks' runner holds a step's records while it needs them.

        ``t.step_records(3, 0)`` is ``{"target": Record(...), "draft_0": ..., "verify": ...}``."""
        return self.step_records_clean(step, rank, bounds=False)[0]

    def step_records_clean(self, step: int, rank: int, *, bounds: bool = True,
                           shared: dict | None = None) -> tuple[dict[str, Record], bool]:
        """(``step_records(step, rank)``, clean): clean True only where ``bounds.step_problems``'
        one-pass test would find no view breaking a bound (``bounds.rows_clean``, read from the
        batch's bytes; False: judge the records). ``bounds`` False: clean is False. ``shared``:
        the caller's dict of the rows read of this step (empty at first; else the trace's own),
        so that two traces of one step share their byte-equal rows as two ranks do (``diff``)."""
        ix, i = self._entry(step, rank)
        layout = ix.layouts[i]
        at_step = int(ix.steps[i])
        whole = shared is not None  # another trace's batches too: look for one of the same bytes
        if shared is None:
            if at_step != self._shared_step:
                self._shared, self._shared_step = {}, at_step
            shared = self._shared
        decoded = decode_step_rows(ix, i, shared, slow_row=decode_row, whole=whole)
        out = {}
        for phase, rows in layout.phases.items():
            views = {layout.views[j]: decoded[j] for j in rows}
            if self.version < 2:
                views = dict(S.upgrade_views(self.version, phase, views))
            out[phase] = Record(int(step), int(rank), phase, MappingProxyType(views), pcp=self._pcp)
        if not bounds or self.version < 2:
            return out, False
        loaded = ix.batch(i)
        return out, rows_clean(layout, loaded.shapes, loaded.offsets_array, u8=loaded.u8, strings=decoded)

    def _decode(self, ix: RankIndex, i: int, phase: str | None, *, share: bool) -> dict:
        """The views of one phase (``phase`` None: every row's array by its row), every payload
        checked against its crc32. ``share``: a payload byte-equal to one another rank recorded
        in the same step, under the same row identity and crc32, is that rank's (verified) array:
        equal bytes under an equal row head give the same crc32, so comparing the bytes checks
        them (a memcmp, not a crc32), and a rank-independent computation on the array can be
        done once (``pcpviz.analysis.checks``).

        Per row the work is a few C calls (this loop is the reader's hot path: 7 million rows
        in a 100,000-step PCP=2 trace): the row's crc32 head (its phase, view, dtype and shape
        text) is one cached ``bytes`` (``batches.row_plan``), its payload a ``memoryview`` slice
        (zlib reads it without a copy), and a numeric array one ``np.ndarray`` over the
        read-only payload bytes (no slice, view and reshape). NumPy, not pyarrow.compute: a
        row is a few dozen bytes, where a pyarrow call's fixed cost is the whole budget."""
        loaded = ix.batch(i)
        layout, step = ix.layouts[i], int(ix.steps[i])
        if share and step != self._shared_step:
            self._shared, self._shared_step = {}, step
        shared = self._shared if share else None
        out: dict = {}
        u8, mv, offsets, crcs, shapes = loaded.u8, loaded.mv, loaded.offsets, loaded.crcs, loaded.shapes
        views, dtypes, prefixes, step_crc = layout.views, layout.dtypes, layout.prefixes, loaded.step_crc
        heads, wants = row_plan(layout, shapes)  # per row: its crc32 head, a numeric row's size
        for j in (range(len(views)) if phase is None else layout.phases[phase]):
            view, shape, crc = views[j], shapes[j], crcs[j]
            start, stop = offsets[j], offsets[j + 1]
            stored = mv[start:stop]  # the row's bytes, read-only, no copy
            at = view if phase is not None else j
            key = None
            if shared is not None:
                key = (prefixes[j], shape, crc)  # the prefix names the row's phase, view and dtype
                seen = shared.get(key)
                if seen is not None and same_bytes(seen[0], stored):
                    out[at] = seen[1]
                    continue
            if zlib.crc32(stored, zlib.crc32(heads[j], step_crc)) != crc:
                raise TraceError(f"{ix.path}: step {step}: view {view!r} (phase {layout.phase_of[j]!r}): "
                                 "corrupt data (crc32 mismatch)")
            if stop - start == wants[j]:  # a numeric row that fits its dtype and shape
                value = np.ndarray(shape, dtypes[j], u8, start)  # read-only: u8 is
            else:
                value = decode_row(ix, layout, j, step=step, shape=shape, stored=u8[start:stop])
            out[at] = value
            if key is not None:
                shared[key] = (stored, value)
        return out


def _resolve_run_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    if p.name == S.RUN_META_FILE and p.parent.is_dir():
        return p.parent
    if p.exists():
        raise TraceError(f"{p}: not a run directory or its {S.RUN_META_FILE}")
    raise TraceError(f"{p}: no such run directory")


def open(path: str | os.PathLike, *, strict: bool = False, cache_size: int = 256) -> Trace:  # noqa: A001
    """Open a run directory (or its run.json) lazily; see the module doc for the error policy.

    ``strict``: raise TraceError for damage that would otherwise be dropped with a warning.
    ``cache_size``: how many decoded records to keep (least recently used are evicted).
    """
    run_dir = _resolve_run_dir(path)
    meta = read_meta(run_dir)
    version = check_version(run_dir / S.RUN_META_FILE, meta[S.META_SCHEMA_KEY])
    files: dict[int, RankFile] = {}
    index: dict[int, RankIndex] = {}
    notes: list[str] = []
    unreadable: dict[int, str] = {}
    rank_paths = []
    try:
        children = sorted(run_dir.iterdir())
    except OSError as exc:
        raise TraceError(f"{run_dir}: cannot list the run directory ({_one_line(exc)})") from None
    for child in children:
        m = S.RANK_FILE_RE.match(child.name)
        if not m:
            continue
        kind = file_kind(child) if len(m.group(1)) <= 4 and int(m.group(1)) < MAX_WORLD_SIZE else \
            f"rank {m.group(1)[:20]} is more than the {MAX_WORLD_SIZE} ranks a trace may have"
        if kind is None:
            rank_paths.append((int(m.group(1)), child))
        else:
            unreadable[int(m.group(1))] = f"{child}: cannot read ({kind})"
    rank_paths.sort()
    for (rank, rank_path), scanned in zip(rank_paths, scan_rank_files(rank_paths, version)):
        if isinstance(scanned, OSError):
            unreadable[rank] = f"{rank_path}: cannot read ({_one_line(scanned)})"
            continue
        ix, facts, note = scanned
        if note is not None:
            if strict:
                raise TraceError(note)
            notes.append(note)
        files[rank] = RankFile(rank, rank_path, tuple(ix.steps.tolist()), **facts)
        index[rank] = ix
    if unreadable and strict:
        raise TraceError(unreadable[min(unreadable)])
    notes += [unreadable[r] for r in sorted(unreadable)]
    for note in notes:
        warnings.warn(note, TraceWarning, stacklevel=2)
    if not any(f.steps for f in files.values()):  # a live run before its first step: say so
        busy = writer_busy(run_dir) or next((f"{f.path.name} is being written" for f in files.values()
                                             if rank_file_busy(f.path)), None)
        if busy:
            empty = (f"{run_dir}: no complete step yet ({busy.split(': ', 1)[-1]}): the trace holds "
                     "0 records (the CLI exits 3 on it)")
            if strict:
                raise TraceError(empty)
            notes.append(empty)
            warnings.warn(empty, TraceWarning, stacklevel=2)
    return Trace(run_dir, meta, files, index, notes, cache_size, unreadable)
