"""Where one rank's finished steps go, off the step's path: its rank file, or the flight
recorder's ring (``pcpviz.trace.procwriter.RankOutput``).

The step's own thread only *stages* a step (``host.StepPack.stage``: one copy to the host
started, one event, no wait) and hands it to the sink. Three sinks, one interface (``submit``,
``drain``, ``dump``, ``stats``, ``meta_changed``, ``close``):

=================  ===================================================================================
``inline``         a strict session (the CPU replay, tests): written on the step's thread, so a bad
                   step raises where it happened
``process``        the plugin's default (``recording.procsink.ProcessSink``): a writer process
                   resolves, encodes and writes; this process only waits for the step's copies on a
                   thin thread (the GIL released while it waits) and sends the bytes
``thread``         ``PCPVIZ_WRITER=thread``, or where no process can be started: a writer thread here
                   (its Python work shares the GIL with vLLM's step loop; the GIL switch interval is
                   at most 0.2 ms meanwhile, ``SWITCH_INTERVAL_S``)
=================  ===================================================================================

Size cap: ``PCPVIZ_TRACE_MAX_MB`` (default 10240) bounds one rank file; the step that would pass
it is not written, one warning says so, and the file ends ``partial`` ("size cap reached").
The flight recorder's ring has its own cap (``PCPVIZ_FLIGHT_MAX_MB``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from pcpviz.trace import TraceWriter
from pcpviz.trace.flight import FlightRing
from pcpviz.trace.procwriter import RankOutput
from pcpviz.vllm.recording.backlog import Backlog, held_bytes
from pcpviz.vllm.recording.staged import StagedStep


__all__ = ["StepSink", "ENV_MAX_MB", "ENV_WRITER", "DEFAULT_MAX_MB", "max_bytes"]

logger = logging.getLogger("vllm.pcpviz")

ENV_MAX_MB = "PCPVIZ_TRACE_MAX_MB"
ENV_WRITER = "PCPVIZ_WRITER"
"""``process`` (default), ``thread`` or ``inline``: where a lenient session's steps are written."""
DEFAULT_MAX_MB = 10240.0
SWITCH_INTERVAL_S = 0.0002  # sys.setswitchinterval while a writer thread runs (see submit)
_STOP = object()


def max_bytes() -> int:
    """``PCPVIZ_TRACE_MAX_MB`` in bytes (a bad value: one warning and the default)."""
    raw = os.environ.get(ENV_MAX_MB, "").strip()
    try:
        mb = float(raw) if raw else DEFAULT_MAX_MB
    except ValueError:
        logger.warning("pcpviz: %s=%r is not a number; using %g", ENV_MAX_MB, raw, DEFAULT_MAX_MB)
        mb = DEFAULT_MAX_MB
    return int(max(mb, 0.001) * (1 << 20))


class StepSink:
    """One rank's destination in this process: inline, or through a writer thread (``threaded``)."""

    kind = "inline"

    def __init__(self, rec: Any, *, threaded: bool) -> None:
        self.rec = rec
        s = rec.session
        self.out = RankOutput(s.run_dir, rec.rank, meta=rec.run_meta, overwrite=s.overwrite, max_bytes=max_bytes(),
                              flight=s.flight, log=logger, catch_signal=not threaded)
        self.threaded = threaded
        self.kind = "thread" if threaded else "inline"
        self._queue: Backlog | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def writer(self) -> TraceWriter | None:
        return self.out.writer

    @property
    def ring(self) -> FlightRing | None:
        return self.out.ring

    def submit(self, step: int, staged: StagedStep) -> None:
        mode = self.rec.session.mode
        if not self.threaded:
            self._write(step, staged, mode)
            return
        if self._queue is None:
            # The writer thread's Python work (resolving, encoding) must not hold the GIL for
            # vLLM's step loop for a whole switch interval (5 ms by default): a short one lets the
            # loop take it back between two of the writer's bytecodes.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self._queue = Backlog(self.rec.rank)  # bounded: a slow disk slows the steps, never OOMs
            self._thread = threading.Thread(target=self._drain, name=f"pcpviz-rank{self.rec.rank}-writer",
                                            daemon=True)
            self._thread.start()
        self._queue.put((step, staged, mode), held_bytes(staged))

    def _drain(self) -> None:
        while True:
            item, nbytes = self._queue.get()
            try:
                if item is _STOP:
                    return
                if not self.rec.disabled:
                    self.rec.guard(self._write, *item)
                else:
                    item[1].release()
            finally:
                self._queue.task_done(nbytes)

    def _write(self, step: int, staged: StagedStep, mode: str) -> None:
        phases = staged.resolve()
        with self._lock:
            if mode == "flight" and self.out.ring is None:
                self.out.flight = self.rec.session.flight
            self.out.write(step, phases, mode)

    def drain(self) -> None:
        """Wait until every submitted step is written."""
        if self._queue is not None:
            self._queue.join()

    def dump(self, trigger: str) -> None:
        """Flight recorder: dump the ring now (after the steps in flight)."""
        self.drain()
        with self._lock:
            self.out.dump(trigger)

    def stats(self) -> dict[str, Any]:
        self.drain()
        with self._lock:
            return self.out.stats()

    def meta_changed(self) -> None:
        with self._lock:
            self.out.meta_changed()

    def close(self, ending: dict[str, str]) -> None:
        """Write what is queued, stop the thread, finalize the rank file and the ring."""
        if self._queue is not None:
            self._queue.put(_STOP)
            self._thread.join()
        with self._lock:
            self.out.close(ending["status"], ending["reason"], strict=self.rec.session.strict)
