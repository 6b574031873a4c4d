"""Lazy trace reader: ``open(run_dir) -> Trace``.

Open reads ``run.json``, then memory-maps each ``rank<N>.arrow`` and walks its record batches.
Arrow reads a batch from a memory map without copying, so the walk touches only the message
headers and the small columns (step, phase, view, dtype, shape, crc32) that it validates and
indexes; the payloads stay on disk until ``record()`` asks for them, and decoded records are kept
in a bounded LRU cache.

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

import math
import mmap
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import numpy as np
import pyarrow as pa

from . import schema as S
from .errors import TraceError, TraceWarning
from .runmeta import check_version, file_kind, open_for_reading, read_meta

__all__ = ["open", "Trace", "Record", "RankFile", "steps_summary"]

MAX_RANKS = 4096
"""Rank files past this many ranks (``rank99999.arrow``) are not read (run.json's pcp is bounded the same)."""
_CONT = b"\xff\xff\xff\xff"  # Arrow IPC continuation marker: every message starts with it
_EOS = _CONT + b"\x00\x00\x00\x00"


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


# --------------------------------------------------------------------------- index entries

@dataclass(frozen=True)
class _Row:
    view: str
    tag: str
    shape: tuple[int, ...]
    crc: int
    index: int  # row in the batch


@dataclass(frozen=True, eq=False)
class _StepEntry:
    """One step of one rank: the (mapped, undecoded) batch and its rows grouped by phase."""

    path: Path
    step: int
    offsets: np.ndarray  # int64[n+1]: payload offsets into `values`
    values: pa.Buffer  # the batch's payload bytes (a slice of the memory map)
    phases: Mapping[str, tuple[_Row, ...]]  # in execution order


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


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


# --------------------------------------------------------------------------- rank files

class _TailDamage(Exception):
    """Unparseable bytes ended the readable part of a rank file (message: what, one line)."""


def _check_header_bytes(path: Path, size: int, head: bytes) -> None:
    """Tell a foreign file (always an error) from a truncated schema header (tail damage)."""
    if head[:4] != _CONT[: len(head[:4])]:
        if head.startswith(b"ARROW1"):
            raise TraceError(f"{path}: an Arrow IPC file, not an Arrow IPC stream (foreign file)")
        raise TraceError(f"{path}: not an Arrow IPC stream (foreign file)")
    if size == 0:
        raise _TailDamage("empty file (the writer died before writing its schema header)")
    if size < 8:
        raise _TailDamage(f"truncated inside its schema header ({size} bytes)")
    meta_len = int.from_bytes(head[4:8], "little", signed=True)
    if meta_len <= 0:
        raise TraceError(f"{path}: not an Arrow IPC stream (foreign file)")
    if 8 + meta_len > size:
        raise _TailDamage(f"truncated inside its schema header ({size} of {8 + meta_len} bytes)")


def _check_schema(path: Path, rank: int, schema: pa.Schema, version: int) -> bool:
    """Raise TraceError for a foreign or mismatched schema; True if the file's writer promised
    a completion record."""
    md = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
          for k, v in (schema.metadata or {}).items()}
    if S.META_SCHEMA_KEY not in md:
        raise TraceError(f"{path}: not a pcpviz rank file (Arrow schema metadata lacks "
                         f"{S.META_SCHEMA_KEY!r})")
    if check_version(path, md[S.META_SCHEMA_KEY]) != version:
        raise TraceError(f"{path}: schema version {md[S.META_SCHEMA_KEY]} but run.json says {version} "
                         "(a file of another run?)")
    if md.get(S.META_RANK_KEY) != str(rank):
        raise TraceError(f"{path}: schema metadata says rank {md.get(S.META_RANK_KEY)!r} but the "
                         f"file name says rank {rank}")
    if not schema.remove_metadata().equals(S.ARROW_SCHEMA):
        raise TraceError(f"{path}: unexpected columns ({_columns(schema)}); expected "
                         f"{_columns(S.ARROW_SCHEMA)}")
    return md.get(S.COMPLETION_KEY) == S.COMPLETION_FILE


def _columns(schema: pa.Schema) -> str:
    names = []
    for i in range(len(schema)):
        try:
            names.append(f"{schema.field(i).name}:{schema.field(i).type}")
        except UnicodeDecodeError:  # a damaged field name
            names.append(f"<undecodable>:{schema.field(i).type}")
    return ", ".join(names)


def _index_batch(path: Path, batch: pa.RecordBatch, number: int, prev: int | None,
                 seen: dict[int, int]) -> _StepEntry:
    """Check a parsed batch and index its rows.

    Raises ``_TailDamage`` when the step's index fails its checksum (the bytes were damaged) and
    ``TraceError`` when an intact step says something wrong (the producer wrote it so).
    """
    if batch.num_rows == 0:
        raise TraceError(f"{path}: record batch #{number}: has no rows")
    for name, col in zip(batch.schema.names, batch.columns):
        if col.null_count:
            raise _TailDamage(f"column {name!r} has nulls")
    steps = batch.column("step").to_numpy()  # int64[n]
    step = int(steps[0])
    phases = batch.column("phase").to_pylist()
    views = batch.column("view").to_pylist()
    tags = batch.column("dtype").to_pylist()
    shapes = batch.column("shape").to_pylist()
    crcs = batch.column("crc32").to_numpy()  # uint32[n]
    step_crcs = batch.column("step_crc32").to_numpy()  # uint32[n]
    data = batch.column("data")
    offsets = np.frombuffer(data.buffers()[1], dtype=np.int64,
                            count=data.offset + len(data) + 1)[data.offset:]  # int64[n+1]
    sizes = np.diff(offsets)  # int64[n]
    expected = S.step_crc32(step, zip(phases, views, tags, shapes, sizes.tolist(), crcs.tolist()))
    if (steps != step).any() or (step_crcs != expected).any():
        raise _TailDamage("index checksum mismatch (step_crc32)")
    if step in seen:
        raise TraceError(f"{path}: step {step}: duplicate step (also record batch #{seen[step]})")
    if prev is not None and step < prev:
        raise TraceError(f"{path}: step {step}: comes after step {prev}; steps must increase")
    where = f"{path}: step {step}"
    by_phase: dict[str, list[_Row]] = {}
    names: set[tuple[str, str]] = set()
    for i, (phase, view, tag, shape) in enumerate(zip(phases, views, tags, shapes)):
        if not S.is_valid_phase(phase):
            raise TraceError(f"{where}: phase {phase!r} is not a valid phase name "
                             "(target, verify, dummy or draft_<k>)")
        if not S.is_valid_view_name(view):
            raise TraceError(f"{where}: view name {view!r} is not an identifier (phase {phase!r})")
        if (phase, view) in names:
            raise TraceError(f"{where}: view {view!r} appears twice in phase {phase!r}")
        names.add((phase, view))
        try:
            dt = S.parse_dtype_tag(tag)
            shape = S.check_shape(shape)
        except ValueError as exc:
            raise TraceError(f"{where}: view {view!r} has {exc} (phase {phase!r})") from None
        if dt is not None:
            want = S.padded_size(math.prod(shape) * dt.itemsize)
            if int(sizes[i]) != want:
                raise TraceError(f"{where}: view {view!r} holds {int(sizes[i])} bytes, expected "
                                 f"{want} for {tag} {list(shape)} (phase {phase!r})")
        by_phase.setdefault(phase, []).append(_Row(view, tag, shape, int(crcs[i]), i))
    ordered = {p: tuple(by_phase[p]) for p in sorted(by_phase, key=S.phase_sort_key)}
    return _StepEntry(path, step, offsets, data.buffers()[2], MappingProxyType(ordered))


def _map(fd: int, size: int) -> pa.BufferReader:
    """A zero-copy Arrow reader over the first ``size`` bytes of ``fd`` (memory-mapped)."""
    if size == 0:
        return pa.BufferReader(b"")
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    return pa.BufferReader(pa.py_buffer(mm))


def _scan_rank_file(path: Path, rank: int, version: int) -> tuple[RankFile, list[_StepEntry], str | None]:
    """Index one rank file; returns (info, steps, tail note or None). Hard problems raise."""
    fd = open_for_reading(path)
    try:
        size = os.fstat(fd).st_size
        with os.fdopen(os.dup(fd), "rb") as fh:
            head = fh.read(8)
        source = _map(fd, size)
    finally:
        os.close(fd)
    entries: list[_StepEntry] = []
    seen: dict[int, int] = {}
    good = 0
    closed = False
    finalizes = False
    note = None
    try:
        _check_header_bytes(path, size, head)
        try:
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceError(f"{path}: not an Arrow IPC stream (foreign file): {_one_line(exc)}") from None
        finalizes = _check_schema(path, rank, reader.schema, version)
        good = source.tell()
        while True:
            try:
                batch = reader.read_next_batch()
                batch.validate(full=True)
            except StopIteration:
                break
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise _TailDamage(f"unreadable data at byte {good} ({_one_line(exc)})") from None
            prev = entries[-1].step if entries else None
            try:
                entries.append(_index_batch(path, batch, len(entries), prev, seen))
            except TraceError:
                raise
            except Exception as exc:  # parsed by Arrow, yet damaged
                raise _TailDamage(f"corrupt record batch at byte {good} ({_one_line(exc)})") from None
            seen[entries[-1].step] = len(entries) - 1
            good = source.tell()
        end = source.tell()
        closed = end - good == len(_EOS)
        good = end
        if good < size:
            where = "the end-of-stream marker" if closed else f"the last message (byte {good})"
            raise _TailDamage(f"{size - good} bytes after {where}")
    except _TailDamage as damage:
        last = f"step {entries[-1].step}" if entries else "no complete step"
        note = (f"{path}: {damage}; last complete step: {last}; "
                f"{size - good} trailing bytes not read")
    info = RankFile(rank, path, tuple(e.step for e in entries), size, good, closed, finalizes)
    return info, entries, note


# --------------------------------------------------------------------------- the trace

class Trace:
    """A run opened lazily: ``meta``, ``steps``, ``ranks``, ``phases()``, ``record()``."""

    def __init__(self, path: Path, meta: dict[str, Any], files: dict[int, RankFile],
                 entries: dict[tuple[int, int], _StepEntry], warnings_: list[str], cache_size: int,
                 unreadable: Mapping[int, str] | None = None):
        self.path = path
        self.meta = meta
        # the schema version that wrote the trace: records are read by its rules (schema.upgrade_views)
        self.version: int = check_version(path / S.RUN_META_FILE, meta[S.META_SCHEMA_KEY])
        self.files: Mapping[int, RankFile] = MappingProxyType(files)
        # rank -> one line: rank files that exist but cannot be read (a directory, a device, ...)
        self.unreadable: Mapping[int, str] = MappingProxyType(dict(unreadable or {}))
        self.warnings: list[str] = warnings_
        self._entries = entries
        self._steps = sorted({step for step, _ in entries})
        self._cache: OrderedDict[tuple[int, int, str], Record] = OrderedDict()
        self._cache_size = max(0, int(cache_size))
        self._lock = threading.Lock()
        pcp = meta.get("pcp")
        self._pcp = pcp if isinstance(pcp, int) and not isinstance(pcp, bool) else None

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
        return list(self._entry(step, rank).phases)

    def has(self, step: int, rank: int, phase: str) -> bool:
        entry = self._entries.get((step, rank))
        return entry is not None and phase in entry.phases

    def record(self, step: int, rank: int, phase: str) -> Record:
        """The views of ``phase`` at ``step`` on ``rank``, decoded on first use (then cached)."""
        key = (step, rank, phase)
        with self._lock:
            rec = self._cache.get(key)
            if rec is not None:
                self._cache.move_to_end(key)
                return rec
        entry = self._entry(step, rank)
        if phase not in entry.phases:
            raise KeyError(f"phase {phase!r} not recorded at step {step} on rank {rank} "
                           f"(phases: {', '.join(entry.phases)})")
        views = S.upgrade_views(self.version, phase, _decode_rows(entry, phase))
        rec = Record(int(step), int(rank), phase, MappingProxyType(dict(views)), pcp=self._pcp)
        with self._lock:
            self._cache[key] = rec
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return rec

    def verify(self) -> int:
        """Decode every record (checking every crc32); returns how many. Raises TraceError."""
        n = 0
        for (step, rank), entry in sorted(self._entries.items()):
            for phase in entry.phases:
                _decode_rows(entry, phase)
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

    def _entry(self, step: int, rank: int) -> _StepEntry:
        info = self._file(rank)
        entry = self._entries.get((step, rank))
        if entry is None:
            raise KeyError(f"step {step!r} not recorded on rank {rank} "
                           f"(rank {rank} has steps {steps_summary(info.steps)})")
        return entry


def _decode_rows(entry: _StepEntry, phase: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for row in entry.phases[phase]:
        start, stop = int(entry.offsets[row.index]), int(entry.offsets[row.index + 1])
        stored = entry.values.slice(start, stop - start)
        where = f"{entry.path}: step {entry.step}: view {row.view!r} (phase {phase!r})"
        if S.row_crc32(entry.step, phase, row.view, tag=row.tag, shape=row.shape, stored=stored) != row.crc:
            raise TraceError(f"{where}: corrupt data (crc32 mismatch)")
        try:
            out[row.view] = S.decode_payload(row.tag, row.shape, stored)
        except ValueError as exc:
            raise TraceError(f"{where}: {exc}") from None
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
    entries: dict[tuple[int, int], _StepEntry] = {}
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
        kind = file_kind(child) if len(m.group(1)) <= 4 and int(m.group(1)) < MAX_RANKS else \
            f"rank {m.group(1)[:20]} is more than the {MAX_RANKS} ranks a trace may have"
        if kind is None:
            rank_paths.append((int(m.group(1)), child))
        else:
            unreadable[int(m.group(1))] = f"{child}: cannot read ({kind})"
    for rank, rank_path in sorted(rank_paths):
        try:
            info, steps, note = _scan_rank_file(rank_path, rank, version)
        except OSError as exc:
            unreadable[rank] = f"{rank_path}: cannot read ({_one_line(exc)})"
            continue
        if note is not None:
            if strict:
                raise TraceError(note)
            notes.append(note)
        files[rank] = info
        for entry in steps:
            entries[(entry.step, rank)] = entry
    if unreadable and strict:
        raise TraceError(unreadable[min(unreadable)])
    notes += [unreadable[r] for r in sorted(unreadable)]
    for note in notes:
        warnings.warn(note, TraceWarning, stacklevel=2)
    return Trace(run_dir, meta, files, entries, notes, cache_size, unreadable)
