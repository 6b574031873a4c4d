"""The index of one rank file: which steps it holds, where each step's record batch lies, and
what rows (phase, view, dtype) each batch has. ``scan_rank_file`` builds it at open.

Open walks every record batch once (Arrow reads a batch from a memory map without copying) and
checks what the reader's policy says open checks (``reader``'s module doc): framing, the step
column, the index checksum ``step_crc32`` and the rows' names, dtypes, shapes and sizes. What it
keeps is small and independent of the payloads: per step its number, the byte range of its
message and its ``Layout`` (the names part of the index, shared by every step with the same
rows), so a 100,000-step trace indexes in a few MB. A step's batch is read again (zero-copy)
when its payloads are decoded (``RankIndex.batch``).

The work per batch is small too: the names and shapes of a batch are parsed and checked once
per distinct content of their columns (steps with the same views and shapes share the work),
and the checksum of the index is one crc32 over the rows' index strings.
"""

from __future__ import annotations

import bisect
import math
import mmap
import zlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import numpy as np
import pyarrow as pa

from . import schema as S
from .errors import TraceError
from .runmeta import check_version, open_for_reading

__all__ = ["Layout", "Loaded", "MapBudget", "RankIndex", "TailDamage", "scan_rank_file", "one_line"]

_CONT = b"\xff\xff\xff\xff"  # Arrow IPC continuation marker: every message starts with it
EOS = _CONT + b"\x00\x00\x00\x00"
_CACHE_MAX = 4096  # distinct name / shape columns remembered while scanning
TRIM_BYTES = 256 << 20
"""Bytes of batches read between two trims of a trace's maps (``MapBudget``)."""


class TailDamage(Exception):
    """Unparseable bytes ended the readable part of a rank file (message: what, one line)."""


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@dataclass(frozen=True, eq=False)
class Layout:
    """The names part of a step's index: every row's phase, view and dtype tag.

    ``phases`` maps each phase, in execution order, to its rows (indices into the batch); a
    PCP=2 K=1 step has e.g. ``{"target": (0, 1, ...), "draft_0": (...), "verify": (...)}``.
    """

    phases: Mapping[str, tuple[int, ...]]
    views: tuple[str, ...]  # per row
    tags: tuple[str, ...]  # per row
    dtypes: tuple[np.dtype | None, ...]  # per row (None: str)
    itemsizes: np.ndarray  # int64[n]: itemsize per row, 0 for str rows
    prefixes: tuple[bytes, ...]  # per row: b"phase\0view\0tag\0" (the step_crc32 string's head)
    phase_of: tuple[str, ...]  # per row


@dataclass(frozen=True)
class _Names:
    """A parsed name column triple: the layout, or the first error (row, message)."""

    layout: Layout | None
    error: tuple[int, str] | None


@dataclass(frozen=True)
class _Shapes:
    """A parsed shape column: per row shape and its text in the index string, or the first
    row whose shape is not a list of non-negative ints."""

    shapes: tuple[tuple[int, ...], ...]
    texts: tuple[bytes, ...]
    counts: np.ndarray  # int64[n]: elements per row (math.prod of its shape)
    error: tuple[int, str] | None


def _parse_names(phases: list, views: list, tags: list) -> _Names:
    by_phase: dict[str, list[int]] = {}
    seen: set[tuple[str, str]] = set()
    dtypes = []
    for i, (phase, view, tag) in enumerate(zip(phases, views, tags)):
        if not S.is_valid_phase(phase):
            return _Names(None, (i, f"phase {phase!r} is not a valid phase name "
                                    "(target, verify, dummy or draft_<k>)"))
        if not S.is_valid_view_name(view):
            return _Names(None, (i, f"view name {view!r} is not an identifier (phase {phase!r})"))
        if (phase, view) in seen:
            return _Names(None, (i, f"view {view!r} appears twice in phase {phase!r}"))
        seen.add((phase, view))
        try:
            dtypes.append(S.parse_dtype_tag(tag))
        except ValueError as exc:
            return _Names(None, (i, f"view {view!r} has {exc} (phase {phase!r})"))
        by_phase.setdefault(phase, []).append(i)
    ordered = {p: tuple(by_phase[p]) for p in sorted(by_phase, key=S.phase_sort_key)}
    layout = Layout(MappingProxyType(ordered), tuple(views), tuple(tags), tuple(dtypes),
                    np.array([0 if d is None else d.itemsize for d in dtypes], dtype=np.int64),
                    tuple(f"{p}\0{v}\0{t}\0".encode("utf-8") for p, v, t in zip(phases, views, tags)),
                    tuple(phases))
    return _Names(layout, None)


def _parse_shapes(col: pa.Array) -> _Shapes:
    shapes, texts, counts = [], [], []
    for i, shape in enumerate(col.to_pylist()):
        try:
            shape = S.check_shape(shape)
        except ValueError as exc:
            return _Shapes((), (), np.zeros(0, np.int64), (i, f"has {exc}"))
        shapes.append(shape)
        texts.append(",".join(map(str, shape)).encode("ascii"))
        counts.append(math.prod(shape))
    big = any(c >= 1 << 62 for c in counts)  # int64 would wrap: such a row can match no size
    arr = np.array([-1 if c >= 1 << 62 else c for c in counts] if big else counts, dtype=np.int64)
    return _Shapes(tuple(shapes), tuple(texts), arr, None)


# The buffers of ``batch.to_struct_array()`` under ``schema.ARROW_SCHEMA``, in order (an array
# read from an IPC stream has offset 0): validity bitmaps, then per column its offsets and data.
_VALIDITY = (0, 1, 3, 6, 9, 12, 14, 16, 19, 21)
_STEP, _NAMES, _SHAPE_OFF, _SHAPE_ITEMS = 2, (4, 5, 7, 8, 10, 11), 13, 15
_DATA_OFF, _DATA, _CRC, _STEP_CRC = 17, 18, 20, 22


class _Parsers:
    """Memos of parsed name and shape columns, by the bytes of their buffers, for one scan."""

    def __init__(self) -> None:
        self.names: dict[tuple, _Names] = {}
        self.shapes: dict[tuple, _Shapes] = {}
        self.formats: dict[tuple[int, int], bytes] = {}  # by (id(names), id(shapes)), both kept above

    def crc_format(self, names: _Names, shapes: _Shapes, *, memo: bool) -> bytes:
        """The rows' index strings with their sizes and crc32s left as ``%d`` (``memo``: both
        parses are kept in this object's memos, so their ids stay theirs)."""
        key = (id(names), id(shapes))
        fmt = self.formats.get(key) if memo else None
        if fmt is None:
            fmt = b"".join((pre + text + b"\0").replace(b"%", b"%%") + b"%d\0%d\0"
                           for pre, text in zip(names.layout.prefixes, shapes.texts))
            if memo:
                self.formats[key] = fmt
        return fmt

    def names_of(self, batch: pa.RecordBatch, bufs: list | None) -> _Names:
        key = None if bufs is None else (batch.num_rows, *(_bytes(bufs[k]) for k in _NAMES))
        got = None if key is None else self.names.get(key)
        if got is None:
            got = _parse_names(*(batch.column(c).to_pylist() for c in ("phase", "view", "dtype")))
            if key is not None:
                if len(self.names) >= _CACHE_MAX:
                    self.names.clear()
                    self.formats.clear()
                self.names[key] = got
        return got

    def shapes_of(self, batch: pa.RecordBatch, bufs: list | None) -> _Shapes:
        key = None if bufs is None else (batch.num_rows, *(_bytes(bufs[k]) for k in (_SHAPE_OFF, _SHAPE_ITEMS)))
        got = None if key is None else self.shapes.get(key)
        if got is None:
            got = _parse_shapes(batch.column("shape"))
            if key is not None:
                if len(self.shapes) >= _CACHE_MAX:
                    self.shapes.clear()
                    self.formats.clear()
                self.shapes[key] = got
        return got


_EMPTY = pa.py_buffer(b"")


def _bytes(buf: pa.Buffer | None) -> bytes:
    return b"" if buf is None else buf.to_pybytes()


def _array(buf: pa.Buffer | None, dtype, count: int | None = None) -> np.ndarray:
    """The buffer as an array (a zero-length buffer arrives as None)."""
    if buf is None:
        return np.zeros(count or 0, dtype=dtype)
    if count is None:  # the whole buffer (a damaged length may leave a partial element at its end)
        count = buf.size // np.dtype(dtype).itemsize
    return np.frombuffer(buf, dtype=dtype, count=count)


def _buffers(batch: pa.RecordBatch) -> list | None:
    """The batch's buffers, or None when a column has a validity bitmap (then every column
    is read through pyarrow, nulls counted, no memo used)."""
    bufs = batch.to_struct_array().buffers()
    return None if any(bufs[k] is not None for k in _VALIDITY) else bufs


def _index_crc(step: int, fmt: bytes, sizes: np.ndarray, crcs: np.ndarray) -> int:
    """``schema.step_crc32`` of a batch: one crc32 over its rows' index strings, formatted at once
    (``_Parsers.crc_format``)."""
    head = f"{step}\0{sizes.shape[0]}\0".encode("utf-8")
    values = np.stack([sizes, crcs.astype(np.int64)], axis=1).ravel().tolist()
    return zlib.crc32(fmt % tuple(values), zlib.crc32(head)) & 0xFFFFFFFF


def _check_batch(path: Path, batch: pa.RecordBatch, number: int, steps_so_far: list[int],
                 parsers: _Parsers) -> tuple[int, Layout]:
    """Check a parsed batch; returns (step, layout).

    Raises ``TailDamage`` when the step's index fails its checksum (the bytes were damaged) and
    ``TraceError`` when an intact step says something wrong (the producer wrote it so)."""
    n = batch.num_rows
    if n == 0:
        raise TraceError(f"{path}: record batch #{number}: has no rows")
    bufs = _buffers(batch)
    if bufs is None:
        for name, col in zip(batch.schema.names, batch.columns):
            if col.null_count:
                raise TailDamage(f"column {name!r} has nulls")
        bufs = batch.to_struct_array().buffers()
        names, shapes = parsers.names_of(batch, None), parsers.shapes_of(batch, None)
        memo = False
    else:
        memo = True
        names, shapes = parsers.names_of(batch, bufs), parsers.shapes_of(batch, bufs)
    steps = _array(bufs[_STEP], np.int64, n)  # int64[n]
    step = int(steps[0])
    prev = steps_so_far[-1] if steps_so_far else None
    crcs = _array(bufs[_CRC], np.uint32, n)  # uint32[n]
    step_crcs = _array(bufs[_STEP_CRC], np.uint32, n)  # uint32[n]
    sizes = np.diff(_array(bufs[_DATA_OFF], np.int64, n + 1))  # int64[n]
    if names.layout is not None and shapes.error is None:
        expected = _index_crc(step, parsers.crc_format(names, shapes, memo=memo), sizes, crcs)
    else:  # a broken row: the slow path gives the same checksum
        pyshapes = batch.column("shape").to_pylist()
        expected = S.step_crc32(step, zip(batch.column("phase").to_pylist(), batch.column("view").to_pylist(),
                                          batch.column("dtype").to_pylist(), pyshapes, sizes.tolist(),
                                          crcs.tolist()))
    if (steps != step).any() or (step_crcs != expected).any():
        raise TailDamage("index checksum mismatch (step_crc32)")
    if prev is not None and step <= prev:
        at = bisect.bisect_left(steps_so_far, step)
        if at < len(steps_so_far) and steps_so_far[at] == step:
            raise TraceError(f"{path}: step {step}: duplicate step (also record batch #{at})")
        raise TraceError(f"{path}: step {step}: comes after step {prev}; steps must increase")
    _check_rows(f"{path}: step {step}", batch, names, shapes, sizes)
    return step, names.layout


def _check_rows(where: str, batch: pa.RecordBatch, names: _Names, shapes: _Shapes, sizes: np.ndarray) -> None:
    """Every row's names, dtype, shape and size; the first bad row raises ``TraceError``. The
    memoized parses answer for a good batch; a bad one is walked row by row, in order."""
    layout = names.layout
    if layout is not None and shapes.error is None:
        numeric = layout.itemsizes > 0
        want = -(-(shapes.counts * layout.itemsizes) // S.ALIGN) * S.ALIGN  # int64[n]
        if not (numeric & ((want != sizes) | (shapes.counts < 0))).any():
            return
    seen: set[tuple[str, str]] = set()
    rows = zip(*(batch.column(c).to_pylist() for c in ("phase", "view", "dtype", "shape")))
    for i, (phase, view, tag, shape) in enumerate(rows):
        if not S.is_valid_phase(phase):
            raise TraceError(f"{where}: phase {phase!r} is not a valid phase name "
                             "(target, verify, dummy or draft_<k>)")
        if not S.is_valid_view_name(view):
            raise TraceError(f"{where}: view name {view!r} is not an identifier (phase {phase!r})")
        if (phase, view) in seen:
            raise TraceError(f"{where}: view {view!r} appears twice in phase {phase!r}")
        seen.add((phase, view))
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


# --------------------------------------------------------------------------- the file

def _check_header_bytes(path: Path, size: int, head: bytes) -> None:
    """Tell a foreign file (always an error) from a truncated schema header (tail damage)."""
    if head[:4] != _CONT[: len(head[:4])]:
        if head.startswith(b"ARROW1"):
            raise TraceError(f"{path}: an Arrow IPC file, not an Arrow IPC stream (foreign file)")
        raise TraceError(f"{path}: not an Arrow IPC stream (foreign file)")
    if size == 0:
        raise TailDamage("empty file (the writer died before writing its schema header)")
    if size < 8:
        raise TailDamage(f"truncated inside its schema header ({size} bytes)")
    meta_len = int.from_bytes(head[4:8], "little", signed=True)
    if meta_len <= 0:
        raise TraceError(f"{path}: not an Arrow IPC stream (foreign file)")
    if 8 + meta_len > size:
        raise TailDamage(f"truncated inside its schema header ({size} of {8 + meta_len} bytes)")


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


@dataclass(frozen=True)
class Loaded:
    """One step's batch as decoding reads it: per row its shape and crc32, and the payloads."""

    shape_offsets: list  # int[n+1]: row j's shape is items[shape_offsets[j]:shape_offsets[j+1]]
    items: np.ndarray  # int64[...]: the shapes' dimensions
    crcs: list  # int[n]
    offsets: list  # int[n+1]: payload offsets into ``values``
    values: pa.Buffer  # the payload bytes (a slice of the map)

    def shape(self, j: int) -> tuple[int, ...]:
        return tuple(self.items[self.shape_offsets[j]:self.shape_offsets[j + 1]].tolist())


class MapBudget:
    """Bytes of batches read from a trace's maps since they were last trimmed: past
    ``TRIM_BYTES`` every rank file's map is trimmed (``RankIndex.trim``), so a pass over the
    steps of a PCP=64 trace holds at most about this much of its files, not 64 times it."""

    def __init__(self, indexes: list) -> None:
        self.indexes, self.touched = indexes, 0

    def spend(self, nbytes: int) -> None:
        self.touched += nbytes
        if self.touched > TRIM_BYTES:
            self.touched = 0
            for ix in self.indexes:
                ix.trim()


class RankIndex:
    """Where each step of one rank file lies: ``steps`` int64[n] (increasing), ``starts`` and
    ``ends`` int64[n] (its message's bytes in the mapped file) and ``layouts`` (one per step,
    shared)."""

    def __init__(self, path: Path, buffer: pa.Buffer, mapped: mmap.mmap | None, schema: pa.Schema | None,
                 steps: list[int], bounds: list[tuple[int, int]], layouts: list[Layout]):
        self.path = path
        self.buffer = buffer  # the whole mapped file
        self.mapped = mapped
        self.schema = schema
        self.steps = np.array(steps, dtype=np.int64)  # int64[n]
        self.starts = np.array([b[0] for b in bounds], dtype=np.int64)  # int64[n]
        self.ends = np.array([b[1] for b in bounds], dtype=np.int64)  # int64[n]
        self.layouts = layouts
        self._last: tuple[int, Loaded] | None = None
        self.budget = MapBudget([self])  # ``reader.open`` makes every rank of a trace share one

    def find(self, step: int) -> int | None:
        """Position of ``step`` in ``steps`` (None if the rank did not record it)."""
        try:
            key = int(step)
            if key != step:  # 1.0 is step 1, 1.5 and "1" are no step
                return None
        except (TypeError, ValueError, OverflowError):
            return None
        if not self.steps.shape[0] or not int(self.steps[0]) <= key <= int(self.steps[-1]):
            return None
        i = int(np.searchsorted(self.steps, key))
        return i if i < self.steps.shape[0] and int(self.steps[i]) == key else None

    def batch(self, i: int) -> "Loaded":
        """The record batch of the ``i``-th step, read again from the map (zero-copy)."""
        last = self._last
        if last is not None and last[0] == i:
            return last[1]
        start, end = int(self.starts[i]), int(self.ends[i])
        step = int(self.steps[i])
        self.budget.spend(end - start)
        try:
            batch = pa.ipc.read_record_batch(self.buffer.slice(start, end - start), self.schema)
            batch.validate(full=True)
            ok = batch.num_rows == len(self.layouts[i].views) and batch.column(0)[0].as_py() == step
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceError(f"{self.path}: step {step}: its record batch changed since the trace "
                             f"was opened ({one_line(exc)})") from None
        if not ok:
            raise TraceError(f"{self.path}: step {step}: its record batch changed since the trace was opened")
        bufs = batch.to_struct_array().buffers()
        n = batch.num_rows
        try:
            loaded = self._loaded(bufs, n)
        except (ValueError, IndexError) as exc:
            raise TraceError(f"{self.path}: step {step}: corrupt index ({one_line(exc)})") from None
        self._last = (i, loaded)
        return loaded

    @staticmethod
    def _loaded(bufs: list, n: int) -> "Loaded":
        return Loaded(_array(bufs[_SHAPE_OFF], np.int32, n + 1).tolist(), _array(bufs[_SHAPE_ITEMS], np.int64),
                      _array(bufs[_CRC], np.uint32, n).tolist(), _array(bufs[_DATA_OFF], np.int64, n + 1).tolist(),
                      bufs[_DATA] if bufs[_DATA] is not None else _EMPTY)

    def trim(self) -> None:
        """Let the kernel drop the mapped pages read so far from this process's memory (they are
        read again from the file when needed): keeps a long read's footprint flat."""
        _trim(self.mapped)


def _trim(mapped: mmap.mmap | None, upto: int | None = None) -> None:
    if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
        try:
            if upto is None:
                mapped.madvise(mmap.MADV_DONTNEED)
            elif upto >= mmap.PAGESIZE:
                mapped.madvise(mmap.MADV_DONTNEED, 0, upto - upto % mmap.PAGESIZE)
        except (OSError, ValueError):
            pass


def _map(fd: int, size: int) -> tuple[pa.Buffer, mmap.mmap | None]:
    """A zero-copy Arrow buffer over the first ``size`` bytes of ``fd`` (memory-mapped)."""
    if size == 0:
        return pa.py_buffer(b""), None
    mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    return pa.py_buffer(mm), mm


def _walk(path: Path, source: pa.BufferReader, reader, good: int, steps: list[int],
          bounds: list[tuple[int, int]], layouts: list[Layout], mapped: mmap.mmap | None) -> int:
    """Index every batch after the schema; returns the bytes of complete messages."""
    parsers = _Parsers()
    trimmed = good
    while True:
        if good - trimmed > TRIM_BYTES:
            _trim(mapped, good)
            trimmed = good
        try:
            batch = reader.read_next_batch()
            batch.validate(full=True)
        except StopIteration:
            return good
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TailDamage(f"unreadable data at byte {good} ({one_line(exc)})") from None
        try:
            step, layout = _check_batch(path, batch, len(steps), steps, parsers)
        except TraceError:
            raise
        except Exception as exc:  # parsed by Arrow, yet damaged
            raise TailDamage(f"corrupt record batch at byte {good} ({one_line(exc)})") from None
        end = source.tell()
        steps.append(step)
        bounds.append((good, end))
        layouts.append(layout)
        good = end


def scan_rank_file(path: Path, rank: int, version: int) -> tuple[RankIndex, dict, str | None]:
    """Index one rank file; returns (index, facts, tail note or None). Hard problems raise.
    ``facts``: size, good_bytes, closed, finalizes (see ``reader.RankFile``)."""
    fd = open_for_reading(path)
    try:
        size = os.fstat(fd).st_size
        with os.fdopen(os.dup(fd), "rb") as fh:
            head = fh.read(8)
        buffer, mapped = _map(fd, size)
    finally:
        os.close(fd)
    source = pa.BufferReader(buffer)
    steps: list[int] = []
    bounds: list[tuple[int, int]] = []
    layouts: list[Layout] = []
    good, closed, finalizes, note, schema = 0, False, False, None, None
    try:
        _check_header_bytes(path, size, head)
        try:
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceError(f"{path}: not an Arrow IPC stream (foreign file): {one_line(exc)}") from None
        schema = reader.schema
        finalizes = _check_schema(path, rank, schema, version)
        good = source.tell()
        good = _walk(path, source, reader, good, steps, bounds, layouts, mapped)
        end = source.tell()
        closed = end - good == len(EOS)
        good = end
        if good < size:
            where = "the end-of-stream marker" if closed else f"the last message (byte {good})"
            raise TailDamage(f"{size - good} bytes after {where}")
    except TailDamage as damage:
        last = f"step {steps[-1]}" if steps else "no complete step"
        note = (f"{path}: {damage}; last complete step: {last}; "
                f"{size - good} trailing bytes not read")
    _trim(mapped)
    index = RankIndex(path, buffer, mapped, schema, steps, bounds, layouts)
    return index, dict(size=size, good_bytes=good, closed=closed, finalizes=finalizes), note
