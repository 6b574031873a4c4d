"""The index of one rank file: which steps it holds, where each step's record batch lies, and
what rows (phase, view, dtype) each batch has. ``scan_rank_file`` builds it at open.

Open walks every record batch once (Arrow reads a batch from a memory map without copying) and
checks what the reader's policy says open checks (``reader``'s module doc): framing, the step
column, the index checksum ``step_crc32`` and the rows' names, dtypes, shapes and sizes. What it
keeps is small and independent of the payloads: per step its number, the byte range of its
message and its ``Layout`` (the names part of the index, shared by every step with the same
rows) and where its batch's payload offsets, payloads and crc32s lie, so a 100,000-step trace
indexes in a few MB. A step's batch is read from there (zero-copy, no second parse of its Arrow
message: ``RankIndex.batch``, ``batches.load_at``) when its payloads are decoded.

What one batch is checked for, and how cheaply, is ``batches``.
"""

from __future__ import annotations

import mmap
import os
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa

from . import schema as S
from .batches import BatchParsers, Layout, Loaded, TailDamage, check_batch, load, load_at, one_line
from .errors import TraceError
from .runmeta import check_version, open_for_reading

__all__ = ["Layout", "Loaded", "MapBudget", "RankIndex", "TailDamage", "fork_map", "scan_rank_file", "scan_rank_files",
           "one_line"]

_CONT = b"\xff\xff\xff\xff"  # Arrow IPC continuation marker: every message starts with it
EOS = _CONT + b"\x00\x00\x00\x00"
TRIM_BYTES = 256 << 20
"""Bytes of batches read between two trims of a trace's maps (``MapBudget``)."""


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
    ``ends`` int64[n] (its message's bytes in the mapped file), ``layouts`` (one per step,
    shared), ``shapes`` (each step's row shapes, shared by the steps of one shape column) and
    ``where`` int64[n, 4] (where its batch's payload offsets, payloads and crc32s lie in the
    mapped file, ``batches.load_at``; None: parse the message again when it is read)."""

    def __init__(self, path: Path, buffer: pa.Buffer, mapped: mmap.mmap | None, schema: pa.Schema | None,
                 steps: list[int], bounds: list[tuple[int, int]], layouts: list[Layout], shapes: list[tuple], *,
                 where: np.ndarray | None = None):
        self.path = path
        self.buffer = buffer  # the whole mapped file
        self.mapped = mapped
        self.schema = schema
        self.steps = np.array(steps, dtype=np.int64)  # int64[n]
        self.starts = np.array([b[0] for b in bounds], dtype=np.int64)  # int64[n]
        self.ends = np.array([b[1] for b in bounds], dtype=np.int64)  # int64[n]
        self.layouts = layouts
        self.shapes = shapes
        self.where = where
        self._last: tuple[int, Loaded] | None = None
        self._found = -1  # the position ``find`` last returned: the next look-up tries the one after
        self.budget = MapBudget([self])  # ``reader.open`` makes every rank of a trace share one

    def find(self, step: int) -> int | None:
        """Position of ``step`` in ``steps`` (None if the rank did not record it)."""
        try:
            key = int(step)
            if key != step:  # 1.0 is step 1, 1.5 and "1" are no step
                return None
        except (TypeError, ValueError, OverflowError):
            return None
        n, i = self.steps.shape[0], self._found
        if 0 <= i < n and int(self.steps[i]) == key:  # the same step again (its phases, one by one)
            return i
        if i + 1 < n and int(self.steps[i + 1]) == key:  # the next: a pass over the steps in order
            self._found = i + 1
            return i + 1
        if not n or not int(self.steps[0]) <= key <= int(self.steps[-1]):
            return None
        i = int(np.searchsorted(self.steps, key))
        if i < n and int(self.steps[i]) == key:
            self._found = i
            return i
        return None

    def batch(self, i: int) -> "Loaded":
        """The record batch of the ``i``-th step, read again from the map (zero-copy)."""
        last = self._last
        if last is not None and last[0] == i:
            return last[1]
        start, end = int(self.starts[i]), int(self.ends[i])
        step = int(self.steps[i])
        self.budget.spend(end - start)
        if self.where is not None and self.where[i, 0] >= 0:  # the walk kept where its buffers lie: no parse
            try:
                loaded = load_at(self.buffer, self.where[i].tolist(), self.shapes[i], step=step)
            except ValueError as exc:
                raise TraceError(f"{self.path}: step {step}: its record batch changed since the trace "
                                 f"was opened ({one_line(exc)})") from None
            self._last = (i, loaded)
            return loaded
        try:
            batch = pa.ipc.read_record_batch(self.buffer.slice(start, end - start), self.schema)
            batch.validate(full=True)
            ok = batch.num_rows == len(self.layouts[i].views)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceError(f"{self.path}: step {step}: its record batch changed since the trace "
                             f"was opened ({one_line(exc)})") from None
        if not ok:
            raise TraceError(f"{self.path}: step {step}: its record batch changed since the trace was opened")
        try:
            loaded = load(batch, step)  # (checks the batch's step column names ``step``)
        except (ValueError, IndexError) as exc:
            raise TraceError(f"{self.path}: step {step}: its record batch changed since the trace "
                             f"was opened ({one_line(exc)})") from None
        self._last = (i, loaded)
        return loaded

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


_UNKNOWN = (-1, -1, -1, -1)
"""``RankIndex.where`` of a batch whose buffers do not lie in its message's bytes (Arrow copied
them): read by parsing its message again."""


def _inside(at: tuple[int, int, int, int], start: int, end: int) -> bool:
    """The buffers ``at`` (``batches.check_batch``'s positions) lie in the message's bytes."""
    offs, data, size, crcs = at
    return start <= offs < end and start <= crcs < end and (data == -1 or start <= data <= data + size <= end)


def _walk(path: Path, source: pa.BufferReader, reader, good: int, steps: list[int],
          bounds: list[tuple[int, int]], layouts: list[Layout], shapes: list[tuple], mapped: mmap.mmap | None, *,
          where: list[tuple[int, int, int, int]], base: int) -> int:
    """Index every batch after the schema; returns the bytes of complete messages."""
    parsers = BatchParsers()
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
            step, layout, step_shapes, at = check_batch(path, batch, steps_so_far=steps, parsers=parsers, base=base)
        except TraceError:
            raise
        except Exception as exc:  # parsed by Arrow, yet damaged
            raise TailDamage(f"corrupt record batch at byte {good} ({one_line(exc)})") from None
        end = source.tell()
        steps.append(step)
        bounds.append((good, end))
        layouts.append(layout)
        shapes.append(step_shapes)
        where.append(at if _inside(at, good, end) else _UNKNOWN)
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
    shapes: list[tuple] = []
    places: list[tuple[int, int, int, int]] = []
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
        good = _walk(path, source, reader, good, steps, bounds, layouts, shapes, mapped, where=places,
                     base=buffer.address)
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
    index = RankIndex(path, buffer, mapped, schema, steps, bounds, layouts, shapes,
                      where=np.array(places, dtype=np.int64).reshape(len(places), 4))
    return index, dict(size=size, good_bytes=good, closed=closed, finalizes=finalizes), note


# --------------------------------------------------------------------------- many files at once

PARALLEL_SCAN_BYTES = 64 << 20
"""Bytes of rank files from which ``scan_rank_files`` scans them in forked processes."""


def fork_workers() -> int:
    """Processes the trace layer may fork: ``$PCPVIZ_WORKERS`` as a number (``1``: never fork), else
    one per CPU, at most 8 (``pcpviz.analysis.parallel.default_workers`` reports a bad setting)."""
    setting = os.environ.get("PCPVIZ_WORKERS", "auto").strip().lower()
    if setting == "auto":
        return min(os.cpu_count() or 1, 8)
    return int(setting) if setting.isdigit() and 1 <= int(setting) <= 256 else 1


def _child(fn, items: range, pack, write_fd: int) -> None:
    """In a forked child: ``pack(fn(i))`` for ``items`` in order, up to the first exception, pickled to
    ``write_fd``; never returns. Dies with its parent (Linux)."""
    try:
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        except (OSError, AttributeError):
            pass
        out = []
        try:
            for i in items:
                out.append(pack(fn(i)))
        except BaseException:  # noqa: BLE001 - the parent computes it again and raises it
            pass
        with os.fdopen(write_fd, "wb") as fh:
            pickle.dump(out, fh, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        os._exit(0)


def _fork(fn, items: range, pack) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(fn, items, pack, w)
    os.close(w)
    return pid, r


def _collect(pid: int, fd: int) -> list:
    """What a child sent (empty when it died or sent nothing readable); the child reaped."""
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read()
        got = pickle.loads(data) if data else []
    except Exception:  # noqa: BLE001 - a child killed mid-write: compute in the parent
        got = []
    finally:
        os.waitpid(pid, 0)
    return got if isinstance(got, list) else []


AGAIN = object()
"""What ``fork_map``'s ``unpack`` returns for a result to compute again in the parent."""


def fork_map(fn, n: int, *, workers: int, pack=lambda x: x, unpack=lambda x: x):
    """``fn(0) ... fn(n - 1)`` in order, the later groups of indices computed in ``workers - 1`` forked
    children while this process computes the first: a child sends ``pack(fn(i))`` (picklable), and
    ``unpack`` of it (``AGAIN``: compute ``fn(i)`` here) is yielded. An index a child could not compute (an
    exception, a crash) and every later one of its group are computed here, in order, so what is
    yielded or raised is what ``[fn(i) for i in range(n)]`` would give: ``fn`` must be pure."""
    workers = max(1, min(workers, n)) if hasattr(os, "fork") else 1
    cuts = [round(g * n / workers) for g in range(workers + 1)]
    children = []
    try:
        for g in range(1, workers):
            children.append((range(cuts[g], cuts[g + 1]), *_fork(fn, range(cuts[g], cuts[g + 1]), pack)))
        for i in range(cuts[0], cuts[1]):
            yield fn(i)
        while children:
            items, pid, fd = children.pop(0)
            got = _collect(pid, fd)
            for k, i in enumerate(items):
                value = unpack(got[k]) if k < len(got) else AGAIN
                yield fn(i) if value is AGAIN else value
    finally:
        for _, pid, fd in children:  # stopped early: the rest are not needed
            try:
                os.kill(pid, 9)
            except OSError:
                pass
            _collect(pid, fd)


def _packed(result):
    """A ``scan_rank_file`` result as a child sends it: the index without its map."""
    if isinstance(result, BaseException):
        return result
    ix, facts, note = result
    return (ix.path, ix.schema, ix.steps.tolist(), list(zip(ix.starts.tolist(), ix.ends.tolist())), ix.layouts,
            ix.shapes, ix.where, facts, note)


def _unpacked(sent):
    """The index a child built, over this process's own map of the file (``AGAIN``: the file is shorter now)."""
    if isinstance(sent, BaseException):
        return sent
    path, schema, steps, bounds, layouts, shapes, where, facts, note = sent
    fd = open_for_reading(path)
    try:
        if os.fstat(fd).st_size < facts["size"]:
            return AGAIN
        buffer, mapped = _map(fd, facts["size"])
    finally:
        os.close(fd)
    return RankIndex(path, buffer, mapped, schema, steps, bounds, layouts, shapes, where=where), facts, note


def scan_rank_files(paths: list[tuple[int, Path]], version: int):
    """``scan_rank_file`` of each (rank, path), in order, an ``OSError`` yielded in place of its
    result; the files scanned in forked processes (``fork_map``) from ``PARALLEL_SCAN_BYTES`` of them.
    What is yielded or raised is what scanning them one after the other gives."""
    def scan(k: int):
        rank, path = paths[k]
        try:
            return scan_rank_file(path, rank, version)
        except OSError as exc:
            return exc

    total = 0
    for _, p in paths:
        try:
            total += p.stat().st_size
        except OSError:
            pass
    workers = fork_workers() if len(paths) > 1 and total >= PARALLEL_SCAN_BYTES else 1
    return fork_map(scan, len(paths), workers=workers, pack=_packed, unpack=_unpacked)
