"""Where one rank's finished steps go (its rank file, or the flight recorder's ring), and the writer
process that does it outside the recording process.

``RankOutput`` is the destination, torch-free: ``write(step, phases, mode)`` (resolved NumPy views;
``mode`` ``record`` or ``flight``), ``dump(trigger)``, ``close(status, reason)``. Size cap:
``max_bytes`` bounds the rank file; the step that would pass it is not written, one warning says
so, and the file ends ``partial`` ("size cap reached"). The vLLM plugin's sinks
(``pcpviz.vllm.recording.sink``) write through one, inline or from a thread, or run one here, in
a process of its own (``python -m pcpviz.trace.procwriter READ_FD WRITE_FD STATE_FD``), so that none
of the resolving, encoding and writing holds the recording process's GIL.

The process's protocol (``multiprocessing.connection`` messages over two pipes):

========================================================  ==================================================
parent -> writer                                          what the writer does
========================================================  ==================================================
``("open", options)``                                     first: run_dir, rank, overwrite, max_bytes, flight
``("meta", run_meta)``                                    run.json's keys now (rewrites it once written)
``("steps", [(step, mode, nbytes, phases, placed)])``     resolves each (``pcpviz.trace.packed``) and writes it;
+ their bytes, one after the other                        a step's bytes are the next ``nbytes``
``("dump", req, trigger)``                                dumps the flight ring, replies ``("reply", req, path)``
``("stats", req)``                                        replies the sizes (bytes written, ring)
``("close", req, status, reason)``                        finalizes, replies, exits
========================================================  ==================================================

The writer sends ``("log", level, message)`` for each warning and ``("error", reason)`` once when a
step cannot be written (it writes none after it). After every step it stores ``steps written,
bytes written, last step`` (int64) in the shared state file ``STATE_FD``, which is what the parent
reads to end the rank file ``partial`` when the process died.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
from typing import Any, Callable

import numpy as np

from .flight import FlightConfig, FlightRing
from .packed import resolve, trim_block_tables
from .meta_model import meta_document
from .writer import TraceWriter, write_run_meta

__all__ = ["RankOutput", "STATE_BYTES", "read_state", "main"]

STATE_BYTES = 64  # int64[8]: steps written, bytes written, last step (-1: none)
NICE = 10  # the writer's niceness: it never takes a core from the recording process's step loop


class RankOutput:
    """One rank's destination for resolved steps: its rank file (opened at the first step
    recorded) or its flight ring (made at the first step kept). ``meta``: run.json's keys
    (rank 0 writes them; a callable, read when the file is opened or a dump is written)."""

    def __init__(self, run_dir: Any, rank: int, *, meta: Callable[[], dict], overwrite: bool, max_bytes: int,
                 flight: FlightConfig | None, log: logging.Logger, catch_signal: bool = False) -> None:
        self.run_dir, self.rank, self.meta, self.overwrite = run_dir, rank, meta, overwrite
        self.catch_signal = catch_signal  # the ring installs PCPVIZ_FLIGHT_SIGNAL's handler (main thread)
        self.max_bytes, self.flight, self.log = max_bytes, flight, log
        self.writer: TraceWriter | None = None
        self.ring: FlightRing | None = None
        self.capped = ""

    def write(self, step: int, phases: dict, mode: str) -> None:
        trim_block_tables(phases)
        if mode == "flight":
            self._ring().write_step(step, phases)
            return
        w = self._writer()
        if self.capped:
            return
        if w.bytes_written > self.max_bytes:
            self.capped = (f"size cap reached: {w.bytes_written / 1e6:.0f} MB (PCPVIZ_TRACE_MAX_MB="
                           f"{self.max_bytes / (1 << 20):g}); steps after {w.last_step} not recorded")
            self.log.warning("pcpviz: PCP rank %d: %s", self.rank, self.capped)
            return
        w.write_step(step, phases)

    def _writer(self) -> TraceWriter:
        if self.writer is None:
            self.writer = TraceWriter(self.run_dir, self.rank, meta=self.meta() if self.rank == 0 else None,
                                      overwrite=self.overwrite)
        return self.writer

    def _ring(self) -> FlightRing:
        if self.ring is None:
            self.ring = FlightRing(self.flight, self.run_dir, self.rank, self.meta, catch_signal=self.catch_signal,
                                   log=self.log)
        return self.ring

    def meta_changed(self) -> None:
        """run.json's keys changed: rank 0 rewrites it once its file is open."""
        if self.writer is not None and self.rank == 0:
            write_run_meta(self.run_dir, self.meta())

    def dump(self, trigger: str) -> str | None:
        out = self.ring.dump(trigger) if self.ring is not None else None
        return None if out is None else str(out)

    def stats(self) -> dict[str, Any]:
        """Bytes of the rank file; the ring's bytes, steps and bytes per kept step."""
        out: dict[str, Any] = {"bytes_written": self.writer.bytes_written if self.writer is not None else 0,
                               "steps_written": self.writer.steps_written if self.writer is not None else 0}
        if self.ring is not None:
            out.update(ring_bytes=self.ring.bytes, ring_steps=len(self.ring.ring),
                       ring_step_bytes=[n for *_, n in self.ring.ring])
        return out

    def close(self, status: str, reason: str, *, strict: bool = False) -> None:
        """Finalize the rank file and the ring (a size cap turns ``complete`` into ``partial``)."""
        if self.capped and status == "complete":
            status, reason = "partial", self.capped
        for sink in (self.writer, self.ring):
            if sink is None:
                continue
            try:
                sink.close(status=status, reason=reason)
            except OSError as exc:
                if strict:
                    raise
                self.log.warning("pcpviz: PCP rank %d: %s (the trace reads as unfinished)", self.rank, exc)


def read_state(buf: Any) -> tuple[int, int, int]:
    """``(steps written, bytes written, last step or -1)`` from a writer process's state."""
    s = np.frombuffer(buf, dtype=np.int64, count=3)
    return int(s[0]), int(s[1]), int(s[2])


class _Forward(logging.Handler):
    """The writer's warnings, sent to the parent (which logs them on its own logger)."""

    def __init__(self, conn: Any) -> None:
        super().__init__(logging.INFO)
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.conn.send(("log", record.levelno, record.getMessage()))
        except Exception:  # noqa: BLE001 - the parent is gone: nothing to tell
            pass


def _store(state: np.ndarray, out: RankOutput) -> None:
    w = out.writer
    if w is not None:
        state[:3] = (w.steps_written, w.bytes_written, -1 if w.last_step is None else w.last_step)


def _serve(inbox: Any, outbox: Any, state: np.ndarray) -> None:
    log = logging.getLogger("pcpviz.procwriter")
    log.propagate = False
    log.addHandler(_Forward(outbox))
    log.setLevel(logging.INFO)
    kind, opts = inbox.recv()
    assert kind == "open", kind
    meta: dict = {}
    out = RankOutput(opts["run_dir"], opts["rank"], meta=lambda: meta, overwrite=opts["overwrite"],
                     max_bytes=opts["max_bytes"], flight=opts["flight"], log=log)
    failed = False
    while True:
        try:
            msg = inbox.recv()
        except EOFError:  # the recording process ended without closing: end the trace partial
            out.close("partial", "the recording process ended without finishing the trace")
            _store(state, out)
            raise
        kind = msg[0]
        if kind == "steps":
            data = inbox.recv_bytes() if any(n for _, _, n, _, _ in msg[1]) else None
            off = 0
            for step, mode, nbytes, phases, placed in msg[1]:
                buf = np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=off) if nbytes else None
                off += nbytes
                if failed:
                    continue
                try:
                    out.write(step, resolve(phases, buf, placed), mode)
                except Exception as exc:  # noqa: BLE001 - one error ends the recording, never the run
                    failed = True
                    outbox.send(("error", "_write", f"{type(exc).__name__}: {exc}"))
            _store(state, out)
        elif kind == "meta":
            meta.clear()
            meta.update(meta_document(msg[1]))
            if not failed:
                out.meta_changed()
        elif kind == "flight":
            out.flight = msg[1]
        elif kind == "dump":
            outbox.send(("reply", msg[1], out.dump(msg[2])))
        elif kind == "stats":
            outbox.send(("reply", msg[1], out.stats()))
        elif kind == "close":
            out.close(msg[2], msg[3])
            _store(state, out)
            outbox.send(("reply", msg[1], out.stats()))
            return


def main(argv: list[str] | None = None) -> int:
    """The writer process: ``READ_FD WRITE_FD STATE_FD`` (inherited from the parent)."""
    from multiprocessing.connection import Connection

    args = [int(a) for a in (sys.argv[1:] if argv is None else argv)]
    try:
        os.nice(NICE)  # where the cores are busy, the recording process's step loop goes first
    except OSError:
        pass
    inbox, outbox = Connection(args[0], writable=False), Connection(args[1], readable=False)
    mm = mmap.mmap(args[2], STATE_BYTES)
    state = np.frombuffer(mm, dtype=np.int64)
    try:
        _serve(inbox, outbox, state)
    except EOFError:  # the parent is gone without closing: what was written stays as it is
        return 1
    finally:
        del state
        mm.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
