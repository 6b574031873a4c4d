"""Stopping a run with SIGINT or SIGTERM without losing what it recorded.

A run of N rank processes must stop *between* two steps: a rank killed mid-step leaves its trace
cut off, and ranks that stop at different steps leave a trace the ranks disagree on. So:

* **ranks** (``catch_rank_stops``): SIGINT and SIGTERM only note the signal
  (``stop_requested``). Rank 0 checks it before scheduling the next step and broadcasts
  ``{STOP_KEY: "SIGINT"}`` in place of the plan; every rank leaves its loop there, closes its
  trace file ``partial`` ("stopped by SIGINT", ``pcpviz.trace.completion``) and exits 0;
* **the launcher** (``catch_stops``, main thread only): forwards the first signal to the ranks
  (Ctrl-C in a terminal reaches them directly as well), waits up to ``STOP_GRACE_S`` for them
  (``await_stop``), then raises ``RunInterrupted``; a second signal kills the ranks at once.

``pcpviz run`` turns ``RunInterrupted`` into one line and exit ``128 + signum``::

    $ pcpviz run --pcp 2 --prompt "def f(" --max-new-tokens 400 --trace runs/x   # Ctrl-C
    pcpviz run: stopped by SIGINT after 7 steps; the trace in runs/x is marked partial
    $ echo $?
    130
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

__all__ = ["STOP_KEY", "STOP_GRACE_S", "RunInterrupted", "StopGuard", "stop_requested", "catch_rank_stops",
           "catch_stops", "forward_stop", "restore_stops", "await_stop", "redeliver"]

STOP_KEY = "pcpviz_stop"
"""Key of the document rank 0 broadcasts instead of a plan when the run is stopped."""

STOP_GRACE_S = 60.0
"""After SIGINT/SIGTERM: how long the ranks get to finish the step in flight and close their
trace files before they are killed."""

_stop: list[str] = []  # this rank process: the name of the first SIGINT/SIGTERM it received


class RunInterrupted(BaseException):
    """SIGINT or SIGTERM stopped the run (``signum``); the message says what the trace holds.

    A ``BaseException``, like ``KeyboardInterrupt``: a host's ``except Exception`` does not turn
    its own termination into an ordinary error. ``pcpviz.run`` re-delivers the signal first
    (``redeliver``), so a host that keeps the default SIGTERM action still dies of it (143)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = int(signum)


def stop_requested() -> str | None:
    """``"SIGINT"`` / ``"SIGTERM"`` once this rank got one, else None."""
    return _stop[0] if _stop else None


def catch_rank_stops() -> None:
    """In a rank process: SIGINT and SIGTERM note a stop instead of killing the rank."""
    def ask(signum, _frame) -> None:
        if not _stop:
            _stop.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ask)


def forward_stop(signum: int, procs: list[subprocess.Popen]) -> None:
    """Send ``signum`` to every rank still running (a rank only notes it)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass


def catch_stops(stops: list[int], procs: list[subprocess.Popen]):
    """In the launcher: the first SIGINT/SIGTERM is appended to ``stops`` and forwarded to
    ``procs`` (a list the caller keeps filling while it starts ranks); a second one kills them.
    Only in the main thread (elsewhere signals keep their handlers); returns the previous
    handlers for ``restore_stops``."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_signal(signum, _frame) -> None:
        stops.append(signum)
        if len(stops) == 1:
            forward_stop(signum, procs)
        else:
            for p in procs:
                if p.poll() is None:
                    p.kill()

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore_stops(previous) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)


def await_stop(stops: list[int], procs: list[subprocess.Popen], result_path: str) -> None:
    """After a stop signal: wait for the ranks (at most ``STOP_GRACE_S``). Returns when every
    rank exited 0 and rank 0 wrote its result (the caller reads it); else kills what is left
    and raises ``RunInterrupted`` saying the trace is incomplete."""
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs) and len(stops) < 2:
        time.sleep(0.05)
    if all(p.poll() == 0 for p in procs) and os.path.exists(result_path):
        return
    for p in procs:
        if p.poll() is None:
            p.kill()
    bad = ", ".join(str(i) for i, p in enumerate(procs) if p.poll() != 0)
    raise RunInterrupted(stops[0], f"stopped by {signal.Signals(stops[0]).name}; rank {bad} did not stop "
                         "cleanly (killed or failed): the trace is incomplete")


class StopGuard:
    """The launcher's side in one object: ``add`` each rank process as it starts (a signal that
    came first reaches it too), ``wait`` in the launcher's poll loop, ``check`` rank 0's result,
    ``close`` in its ``finally``::

        guard = StopGuard()
        try:
            for r in ranks: guard.add(start(r))
            while ...: guard.wait(result_path); ...
            guard.check(result, trace_dir)      # RunInterrupted: "stopped by SIGINT after 7 steps; ..."
        finally:
            guard.close()
    """

    def __init__(self) -> None:
        self.stops: list[int] = []
        self.procs: list[subprocess.Popen] = []
        self._previous = catch_stops(self.stops, self.procs)

    def add(self, proc: subprocess.Popen) -> None:
        self.procs.append(proc)
        if self.stops:
            forward_stop(self.stops[0], [proc])

    def wait(self, result_path: str) -> None:
        if self.stops:
            await_stop(self.stops, self.procs, result_path)

    def check(self, result: dict, trace_dir: str | None) -> None:
        if result.get("stopped"):
            raise RunInterrupted(self.stops[0] if self.stops else signal.SIGINT,
                                 f"stopped by {result['stopped']} after {result['num_steps']} steps; "
                                 + (f"the trace in {trace_dir} is marked partial" if trace_dir
                                    else "no trace was recorded"))

    def close(self) -> None:
        restore_stops(self._previous)


def redeliver(stop: RunInterrupted) -> None:
    """After the trace is finalized and the launcher's handlers are restored: let the host's own
    handling of ``stop.signum`` happen. With the default action (SIGTERM's) the process dies of
    the signal (exit 143) after one line on stderr; a Python handler runs (SIGINT's raises
    ``KeyboardInterrupt`` here); an ignored signal stays ignored. Returns only when the host's
    handler returned (the caller then raises ``stop``). Main thread only (else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(stop.signum)
    if handler == signal.SIG_IGN or handler is None:
        return
    if handler == signal.SIG_DFL:
        print(f"pcpviz.run: {stop}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), stop.signum)
    time.sleep(0.01)  # a Python handler runs at the next bytecode boundary, here
