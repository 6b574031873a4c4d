"""Where one rank's finished steps go, off the step's path: its rank file, or the flight
recorder's ring (``pcpviz.trace.flight``).

The step's own thread only *stages* a step (``host.stage``: copies to pinned memory started, one
event, no wait) and hands it over; a writer thread resolves it (waits for the event, by then
long done), trims the block tables and writes it, so vLLM's next step is never held up by the
host copy, the encoding or the disk. A strict session (the CPU replay) writes inline, so a bad
step raises where it happened.

Size cap: ``PCPVIZ_TRACE_MAX_MB`` (default 10240) bounds one rank file; the step that would pass
it is not written, one warning says so, and the file ends ``partial`` ("size cap reached").
The flight recorder's ring has its own cap (``PCPVIZ_FLIGHT_MAX_MB``). While a writer thread
runs, the process's GIL switch interval is at most 0.2 ms (``SWITCH_INTERVAL_S``), so the step loop
never waits a whole default interval (5 ms) for the writer to let go of the GIL.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from typing import TYPE_CHECKING

from pcpviz.trace import TraceWriter
from pcpviz.trace.flight import FlightRing
from pcpviz.trace.packed import trim_block_tables
from pcpviz.vllm.recording.host import StagedStep

if TYPE_CHECKING:
    from pcpviz.vllm.recording.recorder import RankRecorder

__all__ = ["StepSink", "ENV_MAX_MB", "DEFAULT_MAX_MB"]

logger = logging.getLogger("vllm.pcpviz")

ENV_MAX_MB = "PCPVIZ_TRACE_MAX_MB"
DEFAULT_MAX_MB = 10240.0
SWITCH_INTERVAL_S = 0.0002  # sys.setswitchinterval while a writer thread runs (see submit)
_STOP = object()


def _max_bytes() -> int:
    raw = os.environ.get(ENV_MAX_MB, "").strip()
    try:
        mb = float(raw) if raw else DEFAULT_MAX_MB
    except ValueError:
        logger.warning("pcpviz: %s=%r is not a number; using %g", ENV_MAX_MB, raw, DEFAULT_MAX_MB)
        mb = DEFAULT_MAX_MB
    return int(max(mb, 0.001) * (1 << 20))


class StepSink:
    """One rank's destination: ``submit(step, staged)`` from the step's thread; ``close``."""

    def __init__(self, rec: RankRecorder) -> None:
        self.rec = rec
        self.writer: TraceWriter | None = None
        self.ring: FlightRing | None = None
        self.capped = ""
        self.max_bytes = _max_bytes()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._open_lock = threading.Lock()

    def submit(self, step: int, staged: StagedStep) -> None:
        mode = self.rec.session.mode
        if self.rec.session.strict:
            self._write(step, staged, mode)
            return
        if self._queue is None:
            # The writer thread's Python work (resolving, encoding) must not hold the GIL for
            # vLLM's step loop for a whole switch interval (5 ms by default): a short one lets the
            # loop take it back between two of the writer's bytecodes.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self._queue = queue.Queue(maxsize=256)  # bounded: a slow disk slows the steps, never OOMs
            self._thread = threading.Thread(target=self._drain, name=f"pcpviz-rank{self.rec.rank}-writer",
                                            daemon=True)
            self._thread.start()
        self._queue.put((step, staged, mode))

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if not self.rec.disabled:
                    self.rec.guard(self._write, *item)
            finally:
                self._queue.task_done()

    def _write(self, step: int, staged: StagedStep, mode: str) -> None:
        out = staged.resolve()
        trim_block_tables(out)
        if mode == "flight":
            self._ring().write_step(step, out)
            return
        w = self._writer()
        if self.capped:
            return
        if w.bytes_written > self.max_bytes:
            self.capped = (f"size cap reached: {w.bytes_written / 1e6:.0f} MB ({ENV_MAX_MB}="
                           f"{self.max_bytes / (1 << 20):g}); steps after {w.last_step} not recorded")
            logger.warning("pcpviz: PCP rank %d: %s", self.rec.rank, self.capped)
            return
        w.write_step(step, out)

    def _writer(self) -> TraceWriter:
        with self._open_lock:
            if self.writer is None:
                s, rec = self.rec.session, self.rec
                meta = rec.run_meta() if rec.rank == 0 else None
                self.writer = TraceWriter(s.run_dir, rec.rank, meta=meta, overwrite=s.overwrite)
            return self.writer

    def _ring(self) -> FlightRing:
        with self._open_lock:
            if self.ring is None:
                s, rec = self.rec.session, self.rec
                self.ring = FlightRing(s.flight, s.run_dir, rec.rank, rec.run_meta, log=logger)
            return self.ring

    def drain(self) -> None:
        """Wait until every submitted step is written."""
        if self._queue is not None:
            self._queue.join()

    def dump(self, trigger: str) -> None:
        """Flight recorder: dump the ring now (after the steps in flight)."""
        self.drain()
        if self.ring is not None:
            self.ring.dump(trigger)

    def close(self, ending: dict[str, str]) -> None:
        """Write what is queued, stop the thread, finalize the rank file and the ring."""
        if self._queue is not None:
            self._queue.put(_STOP)
            self._thread.join()
        if self.capped and ending.get("status") == "complete":
            ending = {"status": "partial", "reason": self.capped}
        for sink in (self.writer, self.ring):
            if sink is None:
                continue
            try:
                sink.close(**ending)
            except OSError as exc:
                if self.rec.session.strict:
                    raise
                logger.warning("pcpviz: PCP rank %d: %s (the trace reads as unfinished)", self.rec.rank, exc)

    @property
    def wrote_run_meta(self) -> bool:
        return self.writer is not None
