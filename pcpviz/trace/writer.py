"""Streaming per-rank trace writer and the run's meta file.

Each rank process owns one ``TraceWriter``; nothing is shared between ranks except ``run.json``,
which is written atomically. Rank files are created exclusively (``O_EXCL``) and a directory
claimed by another writer (``owner.claim``) is refused, so two runs never mix in one directory.
One ``write_step`` call is one engine step::

    with TraceWriter(run_dir, rank, meta=meta if rank == 0 else None) as w:
        for step in ...:
            w.write_step(step, {
                "target":  {"positions": pos, "segments": segs, ...},   # int64[T], SEGMENT_DTYPE[S]
                "draft_0": {"view": "rank_local", ...},
                "verify":  {"num_accepted": acc, ...},                  # int[R]
            })

Atomicity: the whole step is validated and encoded first (a bad view raises ``ValueError`` and
writes nothing), then serialized into one IPC message and handed to the kernel with one
``write`` loop. The file is unbuffered at the Python level, so a step that ``write_step``
returned from survives the process being killed (``fsync=True`` additionally survives a machine
crash, at a cost per step). A kill during the write leaves a partial trailing message, which the
reader drops with a warning.

Ending (``pcpviz.trace.completion``): while open the writer holds an exclusive ``flock`` on its
rank file (readers report "still being written"); ``close()`` writes the end-of-stream marker,
then this rank's entry of ``complete.json`` (status ``complete``, or ``partial`` with a reason:
``close(status="partial", reason="stopped by SIGINT")``; leaving a ``with`` block by an
exception closes it ``partial`` with the exception named), and only then releases the file.
A process killed outright leaves neither, so its trace reads as unfinished.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import zlib
from numbers import Integral
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from . import schema as S
from .completion import COMPLETE, PARTIAL, forget, record_end
from .meta_model import RunMeta, meta_document
from .outputs import check_output
from .owner import check_writer, open_regular

__all__ = ["TraceWriter", "write_run_meta"]

_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC end-of-stream marker


def _write_all(fd: int, data) -> None:
    """Write every byte of ``data`` to ``fd`` (os.write may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _meta_text(run_dir: Path, meta: RunMeta | Mapping[str, Any]) -> str:
    """run.json's text (ValueError naming run.json if ``meta`` is not JSON)."""
    doc = S.run_meta_with_version(meta_document(meta))
    try:
        text = json.dumps(doc, indent=2, sort_keys=False, default=_json_default, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{run_dir / S.RUN_META_FILE}: run meta is not JSON: {exc}") from None
    return text + "\n"


def _install_meta(run_dir: Path, text: str, *, replace: bool) -> Path:
    """Write run.json through an fsynced temporary next to it: ``os.replace`` when
    ``replace``, else ``os.link`` (FileExistsError if there is one already)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".run.json.", suffix=".tmp", dir=run_dir)
    final = run_dir / S.RUN_META_FILE
    try:
        try:
            _write_all(fd, text.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            check_output(final)  # a FIFO, device or socket named run.json is not replaced
            os.replace(tmp, final)
        else:
            os.link(tmp, final)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return final


def write_run_meta(run_dir: str | os.PathLike, meta: RunMeta | Mapping[str, Any], *,
                   exclusive: bool = False) -> Path:
    """Write ``run_dir/run.json`` atomically (temp file + ``os.replace``); returns its path.
    ``meta``: the producer's ``RunMeta`` (``RunMeta.build``), or a mapping of its keys.

    ``pcpviz_trace_schema`` is added (first key). NumPy scalars/arrays are converted to JSON.
    ``exclusive``: never replace an existing run.json (FileExistsError naming it).
    """
    run_dir = Path(run_dir)
    text = _meta_text(run_dir, meta)
    try:
        return _install_meta(run_dir, text, replace=not exclusive)
    except FileExistsError:
        raise FileExistsError(f"{run_dir / S.RUN_META_FILE}: already exists; "
                              "write to a new run directory") from None


def _is_placeholder(path: Path, text: str) -> bool:
    """True if there is no run.json, only the placeholder ``_ensure_run_meta`` writes, or
    the same document as ``text`` (another rank of this run wrote the same meta)."""
    if not os.path.lexists(path):
        return True
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as fh:  # a link or FIFO: OSError
            if os.fstat(fh.fileno()).st_size > len(text) + 4096:
                return False
            doc = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and (set(doc) <= {S.META_SCHEMA_KEY} or doc == json.loads(text))


def _ensure_run_meta(run_dir: Path) -> None:
    """Create a placeholder run.json if there is none, never clobbering one another rank wrote.

    ``os.link`` fails if the target exists, so this cannot race with ``write_run_meta``.
    """
    if os.path.lexists(run_dir / S.RUN_META_FILE):
        return
    try:
        _install_meta(run_dir, _meta_text(run_dir, {}), replace=False)
    except FileExistsError:
        pass


def _as_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, Integral):
        raise ValueError(f"step must be an int, got {step!r}")
    step = int(step)
    if not -(2**63) <= step < 2**63:
        raise ValueError(f"step {step} does not fit int64")
    return step


class TraceWriter:
    """Appends one rank's steps to ``run_dir/rank{rank}.arrow``.

    ``meta``: if given, written to run.json (usually by rank 0 only). Without it a placeholder
    run.json (only the schema version) is created when none exists, so the run is readable even
    if no rank passes meta; a writer with ``meta`` replaces only such a placeholder.
    ``overwrite``: replace an existing rank file (its old inode stays valid for readers that
    have it open) and run.json; by default either existing is an error, found before anything
    is created or rewritten, so a re-run never destroys or mixes into a trace.
    ``owner``: the token of the ``owner.claim`` on ``run_dir`` this writer belongs to (a
    directory claimed by another live writer is refused; a claim held by this process needs
    no token).
    ``fsync``: fsync after every step (durable across a machine crash; slower).

    Two PCP=2 runs started together into ``runs/x``: each rank file is created with
    ``O_EXCL``, so whichever run creates ``rank0.arrow`` first owns it and the other run's
    rank 0 gets ``FileExistsError: runs/x/rank0.arrow: already exists``.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, meta: RunMeta | Mapping[str, Any] | None = None,
                 *, overwrite: bool = False, fsync: bool = False, owner: str | None = None):
        if isinstance(rank, bool) or not isinstance(rank, Integral) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.path = self.run_dir / S.rank_file_name(self.rank)
        self.fsync = bool(fsync)
        self.last_step: int | None = None
        self._broken: str | None = None
        self._fd: int | None = None
        # Everything is checked before anything is created: the meta encodes, nobody else
        # owns the directory, the rank file is not there (or may be replaced), and an existing
        # run.json is either a placeholder or may be replaced.
        text = None if meta is None else _meta_text(self.run_dir, meta)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise NotADirectoryError(f"{self.run_dir}: exists and is not a directory")
        if self.run_dir.is_dir():
            check_writer(self.run_dir, owner)
        if not overwrite and (self.path.exists() or self.path.is_symlink()):
            raise FileExistsError(f"{self.path}: already exists; pass overwrite=True to replace it "
                                  "or write to a new run directory")
        meta_path = self.run_dir / S.RUN_META_FILE
        if os.path.islink(meta_path) or (os.path.lexists(meta_path) and not os.path.isfile(meta_path)):
            what = "a symbolic link" if os.path.islink(meta_path) else "not a regular file"
            raise FileExistsError(f"{meta_path}: is {what}; refusing to read or replace it (remove it yourself)")
        if text is not None and not overwrite and not _is_placeholder(meta_path, text):
            raise FileExistsError(f"{meta_path}: already exists with other content (another "
                                  "run's?); pass overwrite=True to replace it or write to a new "
                                  "run directory")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if overwrite and (self.path.exists() or self.path.is_symlink()):
            self.path.unlink()
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise FileExistsError(f"{self.path}: already exists (created by another writer just "
                                  "now); write to a new run directory") from None
        self.steps_written = 0
        self.bytes_written = 0
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "still being written" to readers
            forget(self.run_dir, self.rank)  # an overwritten rank's old ending is not this file's
            if text is not None:
                _install_meta(self.run_dir, text, replace=True)
            else:
                _ensure_run_meta(self.run_dir)
            self._write(S.arrow_schema(self.rank).serialize())
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    # ------------------------------------------------------------------ public

    @property
    def closed(self) -> bool:
        return self._fd is None

    def write_step(self, step: int, phases: Mapping[str, Mapping[str, Any]]) -> None:
        """Append one complete engine step: ``{phase: {view: array-like}}``.

        Raises ValueError (naming the step, phase and view) before writing anything if the step
        does not increase, a phase or view name is invalid, or a value cannot be stored.
        """
        if self._fd is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._broken:
            raise ValueError(f"{self.path}: an earlier write failed ({self._broken}); "
                             "the file ends with a partial step and cannot be appended to")
        step = _as_step(step)
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step {step}: steps must strictly increase on a rank "
                             f"(last written: {self.last_step})")
        batch = self._encode_step(step, phases)
        self._write(batch.serialize())
        self.last_step = step
        self.steps_written += 1

    def close(self, *, status: str = COMPLETE, reason: str = "finished") -> None:
        """Finalize and close (idempotent): the end-of-stream marker, then this rank's entry of
        the completion record (``status`` ``complete`` or ``partial``, ``reason`` why it ended),
        then the file lock is released. After a failed write (a partial step at the end) neither
        is written. OSError (one line) if the record cannot be written; the file is closed
        either way."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if not self._broken:
                _write_all(fd, _EOS)
                self.bytes_written += len(_EOS)
                if self.fsync:
                    os.fsync(fd)
                try:
                    record_end(self.run_dir, self.rank, status=status, reason=reason, steps=self.steps_written,
                               last_step=self.last_step, nbytes=self.bytes_written)
                except OSError as exc:
                    raise OSError(exc.errno, f"{self.run_dir / S.COMPLETION_FILE}: cannot write the completion "
                                  f"record ({exc.strerror or exc})") from None
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)  # also for copies of the fd a fork inherited
            finally:
                os.close(fd)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.close(status=PARTIAL, reason=" ".join(f"{exc_type.__name__}: {exc}".split())[:200])

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"last_step={self.last_step}"
        return f"TraceWriter({str(self.path)!r}, {state})"

    # ------------------------------------------------------------------ internals

    def _write(self, data) -> None:
        try:
            _write_all(self._fd, data)
            self.bytes_written += memoryview(data).nbytes
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise OSError(exc.errno, f"{self.path}: cannot write ({exc.strerror or exc})") from None

    def _encode_step(self, step: int, phases: Mapping[str, Mapping[str, Any]]) -> pa.RecordBatch:
        """Validate and encode every view of the step into one record batch."""
        where = f"step {step}"
        if not isinstance(phases, Mapping) or not phases:
            raise ValueError(f"{where}: phases must be a non-empty dict {{phase: {{view: value}}}}")
        for phase in phases:
            if not S.is_valid_phase(phase):
                raise ValueError(f"{where}: phase {phase!r} is not valid "
                                 "(target, verify, dummy or draft_<k>)")
        rows: list[tuple[str, str, S.Encoded]] = []
        for phase in sorted(phases, key=S.phase_sort_key):
            views = phases[phase]
            if not isinstance(views, Mapping) or not views:
                raise ValueError(f"{where}: phase {phase!r}: views must be a non-empty dict")
            for view, value in views.items():
                if not S.is_valid_view_name(view):
                    raise ValueError(f"{where}: phase {phase!r}: view name {view!r} is not an "
                                     "identifier ([a-z][a-z0-9_]*)")
                try:
                    enc = S.encode_value(value)
                except ValueError as exc:
                    raise ValueError(f"{where}: phase {phase!r}: view {view!r}: {exc}") from None
                rows.append((phase, view, enc))
        return _build_batch(step, rows)


_NAME_COLUMNS: dict[tuple, tuple[pa.Array, pa.Array, pa.Array]] = {}  # (phase, view, tag) rows -> columns
_PAD = {0: b"", **{n: b"\0" * n for n in range(1, S.ALIGN)}}
_SPACES = {0: b"", **{n: b" " * n for n in range(1, S.ALIGN)}}


def _build_batch(step: int, rows: list[tuple[str, str, S.Encoded]]) -> pa.RecordBatch:
    """One record batch; payloads are joined once into a single aligned values buffer (padding:
    zeros, spaces after JSON). The phase/view/dtype columns of a recurring set of rows are reused."""
    parts: list = []
    sizes: list[int] = []
    crcs = np.empty(len(rows), dtype=np.uint32)  # uint32[n]
    for i, (phase, view, enc) in enumerate(rows):
        n = len(enc.payload)
        pad = (_SPACES if enc.tag == S.STR_TAG else _PAD)[-n % S.ALIGN]
        parts.append(enc.payload)
        if pad:
            parts.append(pad)
        sizes.append(n + len(pad))
        head = f"{step}\0{phase}\0{view}\0{enc.tag}\0{','.join(map(str, enc.shape))}\0".encode("utf-8")
        crcs[i] = zlib.crc32(pad, zlib.crc32(enc.payload, zlib.crc32(head))) & 0xFFFFFFFF
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)  # int64[n+1]
    np.cumsum(sizes, out=offsets[1:])
    values = b"".join(parts)
    index_crc = S.step_crc32(step, ((phase, view, enc.tag, enc.shape, size, int(crc))
                                    for (phase, view, enc), size, crc in zip(rows, sizes, crcs)))
    key = tuple((phase, view, enc.tag) for phase, view, enc in rows)
    names = _NAME_COLUMNS.get(key)
    if names is None:
        names = (pa.array([k[0] for k in key], pa.string()), pa.array([k[1] for k in key], pa.string()),
                 pa.array([k[2] for k in key], pa.string()))
        if len(_NAME_COLUMNS) > 512:
            _NAME_COLUMNS.clear()
        _NAME_COLUMNS[key] = names
    data = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(values)])
    return pa.RecordBatch.from_arrays([
        pa.array(np.full(len(rows), step, dtype=np.int64)),
        *names,
        pa.array([list(enc.shape) for _, _, enc in rows], pa.list_(pa.int64())),
        data,
        pa.array(crcs, pa.uint32()),
        pa.array(np.full(len(rows), index_crc, dtype=np.uint32), pa.uint32()),
    ], schema=S.ARROW_SCHEMA)
