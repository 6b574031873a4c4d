"""One record batch of a rank file (one step): checked when a trace is opened (``check_batch``,
which also says where its payload offsets, payloads and crc32s lie in the mapped file) and read
for decoding from there (``load_at``; ``load`` parses the message again where the walk could not
place it).

The work per batch is small: the names and shapes of a batch are parsed and checked once per
distinct content of their columns (``BatchParsers``: steps with the same views and shapes share
the work), and the checksum of the index is one crc32 over the rows' index strings, formatted
at once. A PCP=2 K=1 step of 51 rows has one ``Layout`` shared with every step recording the same
views: ``{"target": (0, ..., 33), "draft_0": (...), "verify": (...)}``.
"""

from __future__ import annotations

import bisect
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import numpy as np
import pyarrow as pa

from . import schema as S
from .errors import TraceError

__all__ = ["Layout", "Loaded", "BatchParsers", "TailDamage", "check_batch", "load", "load_at", "one_line", "phase_rows",
           "same_bytes"]

_CACHE_MAX = 4096  # distinct name / shape columns remembered while scanning


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

    def __reduce__(self):  # a MappingProxyType does not pickle (``index.scan_rank_files`` sends layouts)
        return _layout, (dict(self.phases), self.views, self.tags, self.itemsizes, self.prefixes, self.phase_of)


def _layout(phases: dict, views: tuple, tags: tuple, itemsizes: np.ndarray, prefixes: tuple, phase_of: tuple) -> Layout:
    """A pickled ``Layout``, its dtypes parsed from its tags again: NumPy's own dtype objects, as a
    scan makes them (an unpickled dtype is a copy, on which NumPy's calls are slower)."""
    return Layout(MappingProxyType(phases), views, tags, tuple(S.parse_dtype_tag(t) for t in tags), itemsizes,
                  prefixes, phase_of)


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


class BatchParsers:
    """Memos of parsed name and shape columns, by the bytes of their buffers, for one scan."""

    def __init__(self) -> None:
        self.names: dict[tuple, _Names] = {}
        self.shapes: dict[tuple, _Shapes] = {}
        self.formats: dict[tuple[int, int], bytes] = {}  # by (id(names), id(shapes)), both kept above
        self.sizes: dict[tuple[int, int], tuple] = {}  # by (id(names), id(shapes)), as formats

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

    def sizes_of(self, names: _Names, shapes: _Shapes, *, memo: bool) -> tuple[np.ndarray, np.ndarray]:
        """(numeric rows, their stored sizes) of a good parse, ``_check_rows``' fast test: a
        numeric row holds ``padded_size(count * itemsize)`` bytes (a row whose count does not
        fit int64 no size: its want is a size no row has)."""
        key = (id(names), id(shapes))
        got = self.sizes.get(key) if memo else None
        if got is None:
            layout = names.layout
            rows = np.flatnonzero(layout.itemsizes > 0)
            want = -(-(shapes.counts * layout.itemsizes) // S.ALIGN) * S.ALIGN  # int64[n]
            want = np.where(shapes.counts < 0, np.iinfo(np.int64).min, want)[rows]
            got = (rows, want)
            if memo:
                self.sizes[key] = got
        return got

    def names_of(self, batch: pa.RecordBatch, bufs: list | None) -> _Names:
        key = None if bufs is None else (batch.num_rows, *(_bytes(bufs[k]) for k in _NAMES))
        got = None if key is None else self.names.get(key)
        if got is None:
            got = _parse_names(*(batch.column(c).to_pylist() for c in ("phase", "view", "dtype")))
            if key is not None:
                if len(self.names) >= _CACHE_MAX:
                    self.names.clear()
                    self.formats.clear()
                    self.sizes.clear()
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
                    self.sizes.clear()
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
    values = np.empty(2 * sizes.shape[0], dtype=np.int64)  # size, crc32, size, crc32, ...
    values[0::2], values[1::2] = sizes, crcs
    values = values.tolist()
    return zlib.crc32(fmt % tuple(values), zlib.crc32(head)) & 0xFFFFFFFF


def check_batch(path: Path, batch: pa.RecordBatch, *, steps_so_far: list[int],
                parsers: "BatchParsers", base: int = 0) -> tuple[int, Layout, tuple, tuple[int, int, int, int]]:
    """Check a parsed batch (the file's ``len(steps_so_far)``-th); returns (step, layout, each row's
    shape: one tuple shared by the batches of the same shape column, where its buffers lie:
    ``_where``'s four positions, relative to the address ``base`` of the mapped file).

    Raises ``TailDamage`` when the step's index fails its checksum (the bytes were damaged) and
    ``TraceError`` when an intact step says something wrong (the producer wrote it so)."""
    n = batch.num_rows
    if n == 0:
        raise TraceError(f"{path}: record batch #{len(steps_so_far)}: has no rows")
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
    if names.layout is not None and shapes.error is None:
        rows, want = parsers.sizes_of(names, shapes, memo=memo)
        if np.array_equal(sizes[rows], want):
            return step, names.layout, shapes.shapes, _where(bufs, base)
    _check_rows(f"{path}: step {step}", batch, names, shapes, sizes)
    return step, names.layout, shapes.shapes, _where(bufs, base)


def _where(bufs: list, base: int) -> tuple[int, int, int, int]:
    """(payload offsets at, payloads at, payload bytes, crc32s at): byte positions in the mapped
    file (``base``: its address) of what ``load_at`` reads; payloads at -1 when there are none."""
    data = bufs[_DATA]
    return (bufs[_DATA_OFF].address - base, -1 if data is None else data.address - base,
            0 if data is None else data.size, bufs[_CRC].address - base)


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


@dataclass(frozen=True, slots=True)
class Loaded:
    """One step's batch as decoding reads it: per row its shape and crc32, and the payloads.

    ``shapes`` are parsed once per batch (not once per row read); ``u8`` is the payload bytes as
    a read-only ``uint8`` array (a view of the map): a row's array is a slice of it viewed as
    its dtype (no Python buffer object per row). ``step_crc`` is the crc32 of the row heads'
    common start ``"<step>\\0"`` (``schema.row_crc32`` continues from it)."""

    shapes: list  # tuple[int, ...] per row
    crcs: list  # int[n]
    offsets: list  # int[n+1]: payload offsets into ``values``
    values: pa.Buffer  # the payload bytes (a slice of the map)
    u8: np.ndarray  # uint8[len(values)], read-only, the same bytes
    step_crc: int
    mv: memoryview  # the same bytes again (a slice of it is the cheapest thing zlib reads)
    offsets_array: np.ndarray  # int64[n+1]: ``offsets`` as an array (``bounds.rows_clean`` gathers by it)

    def shape(self, j: int) -> tuple[int, ...]:
        return self.shapes[j]


_HEADS: dict[tuple[bytes, tuple[int, ...]], bytes] = {}


def row_head(prefix: bytes, shape: tuple[int, ...]) -> bytes:
    """A row's crc32 head after its step: ``b"target\\0positions\\0<i8\\03\\0"`` for ``prefix``
    ``b"target\\0positions\\0<i8\\0"`` and shape ``(3,)`` (``schema.row_crc32``), remembered: steps
    repeat their rows' names and most of their shapes."""
    key = (prefix, shape)
    head = _HEADS.get(key)
    if head is None:
        if len(_HEADS) >= _CACHE_MAX:
            _HEADS.clear()
        head = _HEADS[key] = prefix + ",".join(map(str, shape)).encode("ascii") + b"\0"
    return head


_PLANS: dict[tuple[int, int], tuple] = {}


def row_plan(layout: Layout, shapes: tuple) -> tuple[list[bytes], list[int]]:
    """(crc32 head, stored size a numeric row must have; -1 for a string row) of every row of
    a batch of ``layout`` with ``shapes``, made once per (layout, shape column): both objects
    are shared by the steps that repeat them (``load``), so decoding a row looks its head and
    size up instead of formatting and computing them. Two int64 rows of shapes (3,) and (2, 2)
    under ``target``: heads ``b"target\\0positions\\0<i8\\03\\0"``, ..., sizes [24, 32]."""
    key = (id(layout), id(shapes))
    got = _PLANS.get(key)
    if got is None or got[0] is not layout or got[1] is not shapes:
        heads = [row_head(p, s) for p, s in zip(layout.prefixes, shapes)]
        sizes = [-1 if dt is None else S.padded_size(math.prod(s) * dt.itemsize)
                 for dt, s in zip(layout.dtypes, shapes)]
        if len(_PLANS) >= _CACHE_MAX:
            _PLANS.clear()
        got = _PLANS[key] = (layout, shapes, heads, sizes)
    return got[2], got[3]


_ROWS: dict[int, tuple] = {}


def phase_rows(layout: Layout, phase: str) -> Mapping[str, int]:
    """``{view: row}`` of ``phase``'s rows in ``layout``, made once per layout (the steps that
    record the same views share one): ``{"positions": 0, "seq_lens": 1}`` for ``target``'s."""
    got = _ROWS.get(id(layout))
    if got is None or got[0] is not layout:
        if len(_ROWS) >= _CACHE_MAX:
            _ROWS.clear()
        got = _ROWS[id(layout)] = (layout, {ph: MappingProxyType({layout.views[j]: j for j in rows})
                                            for ph, rows in layout.phases.items()})
    return got[1][phase]


_SHAPES: dict[tuple[bytes, bytes], tuple] = {}


def load(batch: pa.RecordBatch, step: int) -> Loaded:
    """What decoding reads of a batch (validated by Arrow): shapes, crc32s, payload offsets.
    The shapes are parsed once per distinct shape column (by its buffers' bytes, ``_SHAPES``):
    steps of one batch size repeat them, and a tuple per row is most of a batch's load."""
    bufs, n = batch.to_struct_array().buffers(), batch.num_rows
    key = (_bytes(bufs[_SHAPE_OFF])[:4 * (n + 1)], _bytes(bufs[_SHAPE_ITEMS]))
    shapes = _SHAPES.get(key)
    if shapes is None:
        so = _array(bufs[_SHAPE_OFF], np.int32, n + 1).tolist()
        items = _array(bufs[_SHAPE_ITEMS], np.int64).tolist()
        shapes = tuple(tuple(items[so[j]:so[j + 1]]) for j in range(n))
        if len(_SHAPES) >= _CACHE_MAX:
            _SHAPES.clear()
        _SHAPES[key] = shapes
    values = bufs[_DATA] if bufs[_DATA] is not None else _EMPTY
    offsets = _array(bufs[_DATA_OFF], np.int64, n + 1)
    if n and int(_array(bufs[_STEP], np.int64, 1)[0]) != step:
        raise ValueError(f"its rows say step {int(_array(bufs[_STEP], np.int64, 1)[0])}")
    return _loaded(shapes, _array(bufs[_CRC], np.uint32, n), offsets, values, step)


def load_at(buffer: pa.Buffer, where: tuple[int, int, int, int], shapes: tuple, *, step: int) -> Loaded:
    """``load`` of a batch that the open walk checked (``check_batch``), read from the mapped file
    ``buffer`` at the positions the walk kept (``where``), without parsing the message again. A
    payload offset outside the payloads raises ValueError (the file changed since it was opened;
    changed payload bytes fail their crc32 when read)."""
    offs_at, data_at, size, crc_at = where
    n = len(shapes)
    offsets = np.frombuffer(buffer, np.int64, n + 1, offs_at)  # int64[n+1]
    if n and (int(offsets[0]) < 0 or int(offsets[-1]) > size or (offsets[1:] < offsets[:-1]).any()):
        raise ValueError("payload offsets outside the payloads")
    values = _EMPTY if data_at < 0 else buffer.slice(data_at, size)
    return _loaded(shapes, np.frombuffer(buffer, np.uint32, n, crc_at), offsets, values, step)


def _loaded(shapes: tuple, crcs: np.ndarray, offsets: np.ndarray, values: pa.Buffer, step: int) -> Loaded:
    u8 = np.frombuffer(values, dtype=np.uint8)
    u8.flags.writeable = False
    return Loaded(shapes, crcs.tolist(), offsets.tolist(), values, u8, zlib.crc32(f"{step}\0".encode("utf-8")),
                  memoryview(u8), offsets)


def same_bytes(a: memoryview, b: memoryview) -> bool:
    """Two payloads hold the same bytes (small ones compared as ``bytes``: a memoryview's own
    ``==`` compares element by element, in Python; large ones as 8-byte words where their size
    allows, five times faster than byte by byte: a 1M-token step's rows are megabytes)."""
    if a.nbytes != b.nbytes:
        return False
    if a.nbytes <= 4096:
        return a.tobytes() == b.tobytes()
    word = np.uint64 if a.nbytes % 8 == 0 else np.uint8
    return bool(np.array_equal(np.frombuffer(a, word), np.frombuffer(b, word)))
