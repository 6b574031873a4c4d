"""How a trace says it ended: the completion record ``complete.json``, written last.

A finished run and one that crashed after its last complete step hold the same bytes in their
rank files, so every writer finalizes on a clean end, in this order (``TraceWriter.close``):

1. the Arrow end-of-stream marker at the end of its rank file;
2. its rank's entry in ``run_dir/complete.json`` (merged under an ``flock`` of the directory,
   written through an fsynced temporary and ``os.replace``), one per rank::

       {"pcpviz_trace_schema": 1,
        "ranks": {"0": {"status": "complete", "reason": "finished", "steps": 13,
                        "last_step": 12, "bytes": 111024, "ended": 1764620000.5},
                  "1": {"status": "partial", "reason": "stopped by SIGINT", ...}}}

A rank file whose Arrow schema metadata carries ``pcpviz_completion`` (every file this pcpviz
writes, from its first byte on) promises that record; ``validate`` then reports the trace
``incomplete`` (the CLI exits 3) unless every rank of ``run.json``'s ``pcp`` has an entry with
status ``complete`` whose step count and byte size match its file, and that file ends with the
end-of-stream marker. A PCP=2 run killed by SIGKILL after step 7 has no record at all::

    incomplete: runs/x/complete.json: missing: no writer finished this trace (killed or crashed
        after its last complete step?); rank files hold steps 0-7

A rank file without the key was written before completion records existed (the real-vLLM and
engine traces shipped in ``data/traces`` before this): its ending is *not recorded* and is not
held against it. Such a trace may carry a record added afterwards with ``"marked": "<who and
why>"`` (``mark_legacy``), which says it finished and is then checked the same way.

A live writer is reported too: each ``TraceWriter`` holds an ``flock`` on its rank file while
open, so a reader sees ``still being written`` instead of a short trace (``live_writers``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from pcpviz.limits import MAX_RECORD_BYTES

from .owner import rank_file_busy, writer_busy
from . import schema as S
from .outputs import check_output

__all__ = ["COMPLETION_FILE", "COMPLETION_KEY", "COMPLETE", "PARTIAL", "STATUSES", "ENTRY_FIELDS",
           "RankEnd", "Completion", "record_end", "forget", "read_completion", "mark_legacy",
           "rank_file_busy", "judge"]

COMPLETION_FILE = S.COMPLETION_FILE
COMPLETION_KEY = S.COMPLETION_KEY

COMPLETE, PARTIAL = "complete", "partial"
STATUSES = {
    COMPLETE: "the rank wrote every step of its run, then its end-of-stream marker",
    PARTIAL: "the rank stopped early but cleanly (a signal, an error, recording switched off, "
             "a flight-recorder window): its steps are a whole prefix; `reason` says why",
}
"""Entry statuses -> meaning."""

ENTRY_FIELDS = {
    "status": "complete or partial",
    "reason": "why it ended: finished, stopped by SIGINT, RuntimeError: ..., flight recorder: ...",
    "steps": "steps in the rank file",
    "last_step": "the last step's number (null for none)",
    "bytes": "size of the rank file when its writer closed it",
    "ended": "wall clock of the close (seconds since the epoch)",
}
"""The fields of one rank's entry -> meaning (docs/trace-format.md)."""



@dataclass(frozen=True)
class RankEnd:
    """One rank's entry: how its writer ended."""

    rank: int
    status: str
    reason: str
    steps: int
    last_step: int | None
    nbytes: int
    ended: float

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "steps": self.steps,
                "last_step": self.last_step, "bytes": self.nbytes, "ended": self.ended}


@dataclass(frozen=True)
class Completion:
    """The completion record of a run directory: entries by rank, and ``marked`` for a record
    added to a trace written before records existed (who marked it and why)."""

    path: Path
    ranks: Mapping[int, RankEnd]
    marked: str | None = None


def _entry(rank: int, doc: Any, where: str) -> RankEnd:
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: rank {rank}: expected an object")
    status, reason = doc.get("status"), doc.get("reason", "")
    if status not in STATUSES:
        raise ValueError(f"{where}: rank {rank}: status {status!r} is not one of {', '.join(STATUSES)}")
    steps, last, nbytes, ended = doc.get("steps"), doc.get("last_step"), doc.get("bytes"), doc.get("ended", 0)
    for name, v, none_ok in (("steps", steps, False), ("last_step", last, True), ("bytes", nbytes, False)):
        if (v is None and not none_ok) or (v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                                                or not 0 <= v < 2**63)):
            raise ValueError(f"{where}: rank {rank}: {name} {v!r} is not an int >= 0")
    if not isinstance(reason, str) or not isinstance(ended, (int, float)) or isinstance(ended, bool):
        raise ValueError(f"{where}: rank {rank}: reason must be a string and ended a number")
    return RankEnd(rank, status, reason, steps, last, nbytes, float(ended))


def read_completion(run_dir: str | os.PathLike) -> Completion | None:
    """The record of ``run_dir`` (None if there is none). ValueError (one line naming the file)
    for a record that is not one: not a regular file, not JSON, a bad entry."""
    from .owner import open_regular

    path = Path(run_dir) / COMPLETION_FILE
    if not os.path.lexists(path):
        return None
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as fh:
            data = fh.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise ValueError(f"{path}: cannot read ({why})") from None
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"{path}: larger than {MAX_RECORD_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid JSON ({' '.join(str(exc).split())[:120]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ranks"), dict):
        raise ValueError(f"{path}: not a completion record (no 'ranks' object)")
    ranks: dict[int, RankEnd] = {}
    for key, entry in doc["ranks"].items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 8):
            raise ValueError(f"{path}: rank key {key!r} is not a rank number")
        ranks[int(key)] = _entry(int(key), entry, str(path))
    marked = doc.get("marked")
    return Completion(path, ranks, marked if isinstance(marked, str) else None)


def _write_record(run_dir: Path, doc: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".complete.json.", suffix=".tmp", dir=run_dir)
    try:
        try:
            data = (json.dumps(doc, indent=1) + "\n").encode("utf-8")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        check_output(run_dir / COMPLETION_FILE)  # a FIFO or device there is not replaced
        os.replace(tmp, run_dir / COMPLETION_FILE)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _merge(run_dir: Path, entries: Mapping[int, RankEnd], marked: str | None, *,
           drop: int | None = None) -> None:
    """Add ``entries`` to the record (and remove rank ``drop``'s) under an exclusive flock of
    the directory."""
    dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        try:
            old = read_completion(run_dir)
        except ValueError:
            old = None  # a damaged record is replaced by this writer's truth
        ranks = {str(r): e.to_dict() for r, e in sorted((old.ranks if old else {}).items()) if r != drop}
        ranks.update({str(r): e.to_dict() for r, e in sorted(entries.items())})
        doc: dict[str, Any] = {S.META_SCHEMA_KEY: S.SCHEMA_VERSION}
        if marked or (old is not None and old.marked):
            doc["marked"] = marked or old.marked
        doc["ranks"] = dict(sorted(ranks.items(), key=lambda kv: int(kv[0])))
        _write_record(run_dir, doc)
    finally:
        os.close(dfd)


def record_end(run_dir: str | os.PathLike, rank: int, *, status: str, reason: str, steps: int,
               last_step: int | None, nbytes: int) -> RankEnd:
    """Write ``rank``'s entry into the run's completion record (called by ``TraceWriter.close``
    after the end-of-stream marker). ValueError for a bad status; OSError if it cannot be
    written (the caller reports it: a trace without its record reads as incomplete)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    end = RankEnd(int(rank), status, " ".join(str(reason).split())[:500], int(steps),
                  None if last_step is None else int(last_step), int(nbytes), round(time.time(), 3))
    _merge(Path(run_dir), {end.rank: end}, None)
    return end


def forget(run_dir: str | os.PathLike, rank: int) -> None:
    """Drop ``rank``'s entry from an existing record: a writer that creates a new rank file (an
    overwrite) has not ended yet. A no-op without a record."""
    if os.path.lexists(Path(run_dir) / COMPLETION_FILE):
        _merge(Path(run_dir), {}, None, drop=int(rank))


def mark_legacy(run_dir: str | os.PathLike, why: str) -> Completion:
    """Add a record to a finished trace written before completion records existed, saying so
    (``why``: who marked it and on what evidence). Every rank file must be readable and whole;
    its entry is taken from the file as it is. Returns the record written."""
    from .reader import open as open_trace

    if not why.strip():
        raise ValueError("say who marks the trace and why (the job's log, its exit status)")
    trace = open_trace(run_dir, strict=True)
    entries = {}
    for r, info in trace.files.items():
        if info.finalizes:
            raise ValueError(f"{info.path}: written by a pcpviz that records its end; nothing to mark")
        entries[r] = RankEnd(r, COMPLETE, "finished (marked after the fact)", len(info.steps),
                             info.steps[-1] if info.steps else None, info.size, round(time.time(), 3))
    _merge(Path(run_dir), entries, " ".join(why.split()))
    return read_completion(run_dir)


def _live_writers(trace: Any) -> list[tuple[str, str | None, str]]:
    """One line per live writer of the trace: the directory's claim, then busy rank files."""
    out = []
    busy = writer_busy(Path(trace.path))
    if busy:
        out.append((str(trace.path), None, f"{busy} (still being written)"))
    for r, info in sorted(trace.files.items()):
        if info.finalizes and rank_file_busy(info.path):
            out.append((str(info.path), f"rank {r}", f"{info.path}: still being written (a live writer "
                        f"holds it; {len(info.steps)} step(s) so far): wait for the run to finish"))
    return out


def judge(trace: Any, pcp: int | None) -> tuple[str, list[tuple[str, str | None, str]]]:
    """How ``trace`` ended, as ``(ending, problems)``: ``ending`` one line for people
    (``complete``, ``partial: stopped by SIGINT (rank 0)``, ``unfinished``, ``being written``,
    ``not recorded (...)``); ``problems`` ``(file, key, message)`` for each way it is incomplete
    (``validate`` reports them as INCOMPLETE). ``pcp``: the ranks run.json promises (None: the
    rank files present)."""
    from .reader import steps_summary

    run_dir = Path(trace.path)
    rec_path = run_dir / COMPLETION_FILE
    live = _live_writers(trace)
    if live:
        return "being written", live
    try:
        rec = read_completion(run_dir)
    except ValueError as exc:
        return "unknown (the completion record is unreadable)", [(str(rec_path), "completion", str(exc))]
    files = dict(trace.files)
    if rec is None:
        if any(info.finalizes for info in files.values()):
            held = steps_summary(sorted(trace.steps))
            return "unfinished", [(str(rec_path), "completion", f"{rec_path}: missing: no writer finished this "
                                   f"trace (killed or crashed after its last complete step?); the rank files "
                                   f"hold steps {held}")]
        return "not recorded (written before pcpviz recorded how a trace ends)", []
    problems: list[tuple[str, str | None, str]] = []
    partial = []
    for r in (range(pcp) if pcp else sorted(files)):
        info, end = files.get(r), rec.ranks.get(r)
        where = str(run_dir / S.rank_file_name(r)) if info is None else str(info.path)
        if end is None:
            if info is not None:
                problems.append((where, f"rank {r}", f"{where}: rank {r} did not finish (no entry in "
                                 f"{COMPLETION_FILE}; killed or crashed after step "
                                 f"{info.steps[-1] if info.steps else 'none'}?)"))
            continue
        if info is None:
            continue  # the missing rank file is validate's line
        if end.status == PARTIAL:
            partial.append(f"{end.reason} (rank {r})")
            problems.append((where, f"rank {r}", f"{where}: partial: {end.reason}; {end.steps} step(s), "
                             f"the last {end.last_step}"))
        elif info.size != end.nbytes or len(info.steps) != end.steps:
            problems.append((where, f"rank {r}", f"{where}: {info.size} bytes and {len(info.steps)} steps, but "
                             f"{COMPLETION_FILE} says {end.nbytes} bytes and {end.steps} steps (changed or cut "
                             "after its writer finished)"))
        elif not info.closed and (info.finalizes or rec.marked is None):  # the old plugin never closed
            problems.append((where, f"rank {r}", f"{where}: no end-of-stream marker, yet {COMPLETION_FILE} "
                             "says its writer finished"))
    if not problems:
        return ("complete" if rec.marked is None else f"complete (marked after the fact: {rec.marked})"), []
    return (f"partial: {partial[0]}" if partial else "unfinished"), problems
