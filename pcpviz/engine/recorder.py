"""Asynchronous trace recording: the step hands its record over and goes on.

``submit(step, phases)`` starts a non-blocking copy of every ``Pending`` (device) view into
pinned host memory, records one CUDA event after them, and queues the step; a background
thread waits for the event, finishes the views (int64 tokens, ``row_hashes`` of hidden
states) and writes the step with the ``TraceWriter``: the same bytes, in the same order, as
writing it inline (``tests/engine/test_engine_perf.py`` compares the files).

Bounded: at most ``depth`` steps are in flight (their host copies live in PyTorch's caching
pinned-memory pool, reused once written). A step arriving while ``depth`` are queued waits
for the oldest one to be written, so nothing is dropped and memory stays bounded; the wait
is the only way disk speed can reach the engine loop.

A rank killed outright (SIGKILL, ``os._exit``) loses the steps still queued, at most ``depth``
(an inline writer would lose the one being written); a rank failing with an exception closes
the recorder first (``rank_main``), so every step it completed is on disk.

Errors: the first failure of the writer thread (a full disk, a bad value) is kept, later
steps are not written, and ``submit`` and ``close`` raise it as one line naming the file and
the step, e.g. ``OSError: runs/t/rank0.arrow: step 7: cannot write (No space left on
device)``; ``close`` always closes the file. So a run never ends "successfully" with steps
missing.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from pcpviz.engine.record import Pending

__all__ = ["AsyncRecorder"]

_STOP = object()


class AsyncRecorder:
    def __init__(self, writer, *, depth: int = 64) -> None:
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pcpviz-trace-writer", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- engine side
    def submit(self, step: int, phases: dict) -> None:
        """Queue one step (``{phase: {view: array | Pending}}``); never waits for the device."""
        self._raise_if_failed()
        copies = []  # (phase, view, pending, host tensor)
        cuda = False
        for phase, views in phases.items():
            for view, value in views.items():
                if isinstance(value, Pending):
                    t = value.tensor
                    if t.is_cuda:
                        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        host.copy_(t, non_blocking=True)
                        cuda = True
                    else:
                        host = t.clone()
                    copies.append((phase, view, value, host))
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._queue.put((step, phases, copies, event))

    def flush(self) -> None:
        """Wait until every submitted step is written (or the writer has failed)."""
        self._queue.join()

    def close(self, **ending) -> None:
        """Write what is queued, stop the thread, close the file (``ending``: ``status`` and
        ``reason`` for ``TraceWriter.close``); raise the writer's error. A writer that failed
        closes ``partial``, naming its error."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()
        if self._error is not None:
            ending = {"status": "partial", "reason": f"writer failed at step {self._error_step}: "
                      + " ".join(str(self._error).split())[:160]}
        try:
            self.writer.close(**ending)
        finally:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            e = self._error
            line = " ".join(str(e).split())
            if self._error_step is not None and f"step {self._error_step}" not in line:
                line = f"step {self._error_step}: {line}"
            if str(self.writer.path) not in line:
                line = f"{self.writer.path}: {line}"
            raise type(e)(line) if isinstance(e, (OSError, ValueError)) \
                else RuntimeError(f"{type(e).__name__}: {line}")

    # ---------------------------------------------------------------- writer thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if self._error is None:  # after a failure nothing more is written
                    self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, step, phases, copies, event) -> None:
        try:
            if event is not None:
                event.synchronize()
            for phase, view, pending, host in copies:
                phases[phase][view] = pending.resolve(np.asarray(host.numpy()))
            self.writer.write_step(step, phases)
        except BaseException as e:  # noqa: BLE001 - reported by submit/close
            self._error, self._error_step = e, step
