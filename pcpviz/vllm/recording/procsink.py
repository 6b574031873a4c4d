"""The plugin's sink: a writer process per recording rank (``pcpviz.trace.procwriter``), so that
resolving, encoding and writing a step never hold this process's GIL.

This process keeps two thin threads per rank: the *sender* takes the staged steps from a bounded
queue (``recording.backlog``: in steps and in host bytes), ``DRAIN_PERIOD_S`` after the first of
them arrived all that are queued by then, copies their device spans into one host buffer behind
their CUDA events (``staged.drain_steps``: one wait, the GIL released while it waits), and sends
their descriptors and bytes down a pipe (one message, one ``write``); the *listener* relays what
the writer says (warnings, an error, replies). The step's own thread only puts the
staged step on the queue. The process is started with ``subprocess`` (no fork of a process with
CUDA and threads, no re-import of the user's ``__main__``), at the first step.

Failures end as they would inline: an error while writing a step is one warning and recording
switched off for the rank (the file ends ``partial``); a writer process that died is one warning,
recording switched off, and the rank file ended ``partial`` from here (cut to the last step the
process reported written, the end-of-stream marker, the completion record); nothing waits on a
dead process. Flight mode: the writer holds the ring; a dump (signal, exception, shutdown) is a
message, acceptance is judged in the writer. ``PCPVIZ_FLIGHT_SIGNAL`` is caught here (main thread)
and sent on.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import signal as signals
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pcpviz
from pcpviz.trace.completion import record_end
from pcpviz.trace.procwriter import STATE_BYTES, read_state
from pcpviz.trace.schema import rank_file_name
from pcpviz.vllm.recording.backlog import Backlog, held_bytes
from pcpviz.vllm.recording.staged import StagedStep, drain_steps, host_pool
from pcpviz.vllm.recording.sink import ENV_WRITER, StepSink, max_bytes


__all__ = ["ProcessSink", "REPLY_TIMEOUT_S", "make_sink"]

logger = logging.getLogger("vllm.pcpviz")

DRAIN_PERIOD_S = 0.02
"""The sender waits this long after a step arrives and takes every step queued by then together:
one host copy, one wait and one message for all of them. Each wait or pipe write releases the GIL,
and getting it back while vLLM's thread runs Python forces a switch on that thread; per step, that
cost more than the sender's own work (one H200, 2026-12-04: 479 us of sender CPU per batch-1
decode step when each step went alone)."""
BATCH_STEPS = 64  # steps a batch takes at most (a batch's bytes are one host buffer)
REPLY_TIMEOUT_S = 120.0  # a dump or the close of a live writer process; a dead one is noticed at once
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_STOP = object()
_START = object()
"""Queued first, when the sink is made (a recorder's first hook, during vLLM's start-up): the sender
starts the writer process then rather than at the first step, so that its start-up is not on the
steps' way, and a request (``drain`` first) waits for it like for a step. A short run needs that:
vLLM's shutdown gives the engine process 5 s after SIGTERM, then kills it and the writer. One H200
run (2026-12-03, 3 prompts of 32 tokens, 0.22 s of generation, the writer started at the first
step) was killed with no step written; whether the writer's start-up was the whole cause was not
established on that machine."""
_signal_sinks: list[ProcessSink] = []
_signal_lock = threading.Lock()


class ProcessSink:
    """One rank's steps, written by a process of its own (see the module doc)."""

    kind = "process"

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.proc: subprocess.Popen | None = None
        self.dead = ""
        self.closed = False
        self.opened_file = False  # a record-mode step was sent: the writer opens the rank file
        self._queue = Backlog(rec.rank)  # bounded in steps and bytes: a slow writer slows the steps
        self._send_lock = threading.Lock()
        self._replies: dict[int, Any] = {}
        self._reply_cv = threading.Condition()
        self._req = itertools.count()
        self._meta_dirty = True
        self._flight_sent: Any = None
        self._state: mmap.mmap | None = None
        self.sender_ns = [0, 0, 0]  # the sender thread's CPU time, wall time and steps sent (``_send_step``)
        _catch_flight_signal(self)
        self._sender = threading.Thread(target=self._send_loop, name=f"pcpviz-rank{rec.rank}-sender", daemon=True)
        self._sender.start()
        self._queue.put(_START)  # the writer process starts now, not at the first step (see ``_START``)

    # ------------------------------------------------------------------ the step's thread
    def submit(self, step: int, staged: StagedStep) -> None:
        if self.dead or self.closed:
            staged.release()
            return
        self._queue.put((step, staged, self.rec.session.mode), held_bytes(staged))

    def meta_changed(self) -> None:
        self._meta_dirty = True

    # ------------------------------------------------------------------ the sender thread
    def _start(self) -> None:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        state = tempfile.TemporaryFile()
        state.truncate(STATE_BYTES)
        self._state = mmap.mmap(state.fileno(), STATE_BYTES)
        fds = (r1, w2, state.fileno())
        env = dict(os.environ)  # the writer imports this process's pcpviz
        root = str(Path(pcpviz.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "pcpviz.trace.procwriter", *map(str, fds)],
                                         pass_fds=fds, stdin=subprocess.DEVNULL, env=env, close_fds=True)
        finally:
            os.close(r1)
            os.close(w2)
            state.close()
        self._out = Connection(w1, readable=False)
        self._in = Connection(r2, writable=False)
        threading.Thread(target=self._listen, name=f"pcpviz-rank{self.rec.rank}-listener", daemon=True).start()
        s = self.rec.session
        self._send(("open", {"run_dir": str(s.run_dir), "rank": self.rec.rank, "overwrite": s.overwrite,
                             "max_bytes": max_bytes(), "flight": s.flight}))

    def _send(self, msg: Any, data: Any = None) -> None:
        with self._send_lock:
            self._out.send(msg)
            if data is not None:
                self._out.send_bytes(data)

    def _send_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first[0] is _STOP:
                self._queue.task_done(first[1])
                return
            batch = [first]
            if isinstance(first[0], tuple):  # a step: let a few more steps come, then take them together
                time.sleep(DRAIN_PERIOD_S)
                batch += self._queue.get_ready(BATCH_STEPS - 1)
            stop = self._run_batch(batch)
            if stop:
                return

    def _run_batch(self, batch: list[tuple[Any, int]]) -> bool:
        """Take the items in order: the steps between two controls go to the writer together. True
        when ``_STOP`` was among them (what came after it is let go)."""
        steps: list[tuple[int, StagedStep, str]] = []
        stopped = False
        try:
            for item, _ in batch:
                if item is _STOP or item is _START:
                    self._guarded(self._send_steps, steps)
                    steps = []
                    if item is _STOP:
                        stopped = True
                        break
                    self._guarded(self._start)  # the first item: every step finds the writer started (or dead)
                elif stopped:
                    item[1].release()
                else:
                    steps.append(item)
            self._guarded(self._send_steps, steps)
        finally:
            for _, nbytes in batch:
                self._queue.task_done(nbytes)
        return stopped

    def _run_meta(self) -> Any:
        """The recorder's run.json (``RankRecorder.run_meta``); None, and recording switched off with
        the reason, when a key it learnt is no field or malformed (a recorder bug, not the writer's)."""
        try:
            return self.rec.run_meta()
        except (TypeError, ValueError) as exc:
            self._error("run.json", str(exc))
            return None

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - never into vLLM: the rank stops recording
            self._lost(f"{type(exc).__name__}: {exc}")

    def _send_steps(self, items: list[tuple[int, StagedStep, str]]) -> None:
        """Steps to the writer process: their bytes to the host in one copy and one message."""
        if not items:
            return
        if self.dead or self.rec.disabled:
            for _, staged, _ in items:
                staged.release()
            return
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        host = None
        try:
            buf, sizes, host = drain_steps([staged for _, staged, _ in items])
            if self._meta_dirty:
                self._meta_dirty = False
                meta = self._run_meta()
                if meta is None:
                    return
                self._send(("meta", meta))
            flight = self.rec.session.flight
            if any(mode == "flight" for _, _, mode in items) and self._flight_sent is not flight:
                self._flight_sent = flight
                self._send(("flight", flight))
            self.opened_file = self.opened_file or any(mode == "record" for _, _, mode in items)
            descr = [(step, mode, n, staged.phases, staged.placed) for (step, staged, mode), n in zip(items, sizes)]
            self._send(("steps", descr), buf)
        finally:
            for _, staged, _ in items:
                staged.release()
            if host is not None:
                host_pool().give(host)
            acc = self.sender_ns
            acc[0] += time.thread_time_ns() - c0
            acc[1] += time.perf_counter_ns() - t0
            acc[2] += len(items)

    # ------------------------------------------------------------------ the listener thread
    def _listen(self) -> None:
        while True:
            try:
                msg = self._in.recv()
            except (EOFError, OSError):
                if not self.closed or self.proc.poll() not in (0, None):
                    self._lost(f"exit code {self.proc.wait()}")
                with self._reply_cv:
                    self._reply_cv.notify_all()
                return
            kind = msg[0]
            if kind == "log":
                logger.log(msg[1], "%s", msg[2])
            elif kind == "error":
                self._error(msg[1], msg[2])
            elif kind == "reply":
                with self._reply_cv:
                    self._replies[msg[1]] = msg[2]
                    self._reply_cv.notify_all()

    def _error(self, where: str, what: str) -> None:
        rec = self.rec
        if rec.disabled:
            return
        rec.disabled = True
        rec.disabled_reason = f"recording switched off after an error in {where}: {' '.join(what.split())[:160]}"
        logger.warning("pcpviz: recording disabled on PCP rank %d after an error in %s: %s (vLLM continues "
                       "unaffected)", rec.rank, where, what)

    def _lost(self, why: str) -> None:
        """The writer process is gone (or cannot be reached): one warning, recording off."""
        if self.dead:
            return
        self.dead = f"the trace writer process died ({why})"
        rec = self.rec
        if not rec.disabled:
            rec.disabled = True
            rec.disabled_reason = self.dead
        logger.warning("pcpviz: PCP rank %d: %s; recording switched off, the trace ends partial (vLLM continues "
                       "unaffected)", rec.rank, self.dead)
        with self._reply_cv:
            self._reply_cv.notify_all()

    # ------------------------------------------------------------------ requests
    def _request(self, *msg: Any) -> Any:
        """Send a request after the queued steps and wait for its reply (None if the writer is
        gone or never started)."""
        self.drain()
        if self.proc is None or self.dead:
            return None
        req = next(self._req)
        try:
            self._send((msg[0], req, *msg[1:]))
        except OSError as exc:
            self._lost(f"{type(exc).__name__}: {exc}")
            return None
        with self._reply_cv:
            ok = self._reply_cv.wait_for(lambda: req in self._replies or self.dead, REPLY_TIMEOUT_S)
            if not ok:
                self._lost(f"no reply to {msg[0]} in {REPLY_TIMEOUT_S:g} s")
            return self._replies.pop(req, None)

    def drain(self) -> None:
        """Wait until every submitted step was handed to the writer process."""
        self._queue.join()

    def dump(self, trigger: str) -> None:
        """Flight recorder: dump the ring now (after the steps in flight)."""
        self._request("dump", trigger)

    def stats(self) -> dict[str, Any]:
        """What the writer holds: ``bytes_written``, ``steps_written``; ``ring_bytes`` /
        ``ring_steps`` / ``ring_step_bytes`` in flight mode ({} before the first step)."""
        return self._request("stats") or {}

    def close(self, ending: dict[str, str]) -> None:
        """Send what is queued, finalize the rank file and the ring in the writer, stop it; a
        dead writer's rank file is ended ``partial`` from here."""
        if self.closed:
            return
        self._queue.put(_STOP)
        self._sender.join()
        self.closed = True
        if self.proc is not None and not self.dead:
            if self._meta_dirty:
                self._meta_dirty = False
                meta = self._run_meta()
                try:
                    if meta is not None:
                        self._send(("meta", meta))
                except OSError as exc:
                    self._lost(f"{type(exc).__name__}: {exc}")
            status, reason = ending["status"], ending["reason"]
            if self.rec.disabled_reason and status == "complete":
                status, reason = "partial", self.rec.disabled_reason
            self._request_close(status, reason)
        if self.dead:
            self._end_dead_file()
        with _signal_lock:
            if self in _signal_sinks:
                _signal_sinks.remove(self)

    def _request_close(self, status: str, reason: str) -> None:
        req = next(self._req)
        try:
            self._send(("close", req, status, reason))
        except OSError as exc:
            self._lost(f"{type(exc).__name__}: {exc}")
            return
        with self._reply_cv:
            if not self._reply_cv.wait_for(lambda: req in self._replies or self.dead, REPLY_TIMEOUT_S):
                self._lost(f"no reply to close in {REPLY_TIMEOUT_S:g} s")
        if not self.dead:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _end_dead_file(self) -> None:
        """The writer died: cut the rank file to its last complete step, write the end-of-stream
        marker and the completion record (``partial``, the reason) from here."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self.opened_file or self._state is None:
            return
        steps, nbytes, last = read_state(self._state)
        path = self.rec.session.run_dir / rank_file_name(self.rec.rank)
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            return  # never created: nothing to end
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if nbytes:
                os.ftruncate(fd, nbytes)
                os.lseek(fd, nbytes, os.SEEK_SET)
                os.write(fd, _EOS)
            record_end(self.rec.session.run_dir, self.rec.rank, status="partial", reason=self.rec.disabled_reason
                       or self.dead, steps=steps, last_step=None if last < 0 else last,
                       nbytes=nbytes + len(_EOS) if nbytes else 0)
        except OSError as exc:
            logger.warning("pcpviz: PCP rank %d: cannot end %s after its writer died: %s", self.rec.rank, path, exc)
        finally:
            os.close(fd)


def _catch_flight_signal(sink: ProcessSink) -> None:
    """``PCPVIZ_FLIGHT_SIGNAL`` dumps every process sink's ring (a helper thread sends the
    dumps; the handler only wakes it). Installed from the main thread only."""
    cfg = sink.rec.session.flight
    with _signal_lock:
        _signal_sinks.append(sink)
        if cfg is None or cfg.signal is None or _installed_signals or \
                threading.current_thread() is not threading.main_thread():
            return
        wake = threading.Event()
        try:
            signals.signal(cfg.signal, lambda *_: wake.set())
        except (ValueError, OSError):
            return
        _installed_signals.add(cfg.signal)

    def loop() -> None:
        while True:
            wake.wait()
            wake.clear()
            name = signals.Signals(cfg.signal).name
            for s in list(_signal_sinks):
                if not s.closed and s.rec.session.mode == "flight":
                    s.dump(f"signal {name}")

    threading.Thread(target=loop, name="pcpviz-flight-signal", daemon=True).start()


_installed_signals: set[int] = set()


def make_sink(rec: Any) -> Any:
    """The sink of a recorder: inline for a strict session, else ``$PCPVIZ_WRITER`` (process)."""
    if rec.session.strict:
        return StepSink(rec, threaded=False)
    kind = os.environ.get(ENV_WRITER, "").strip().lower() or "process"
    if kind not in ("process", "thread", "inline"):
        logger.warning("pcpviz: %s=%r: expected process, thread or inline; using process", ENV_WRITER, kind)
        kind = "process"
    if kind == "process":
        return ProcessSink(rec)
    return StepSink(rec, threaded=kind == "thread")
