"""The recorder's process state, shared by the hooks and below all of them: the draft context of
the ``propose`` running on this thread, vLLM's warm-up, the session the process records into,
and which recorder an object feeds. Nothing here imports another ``recording`` module: the
hooks (``wrappers``, ``graphs``, ``patching``), the ``RankRecorder`` and the sessions all read
this one place (the import graph runs one way: ``tests/repo/test_import_graph.py``).

A PCP=2 step on rank 1: ``propose`` runs inside ``drafting(ctx)``, so the ``_run_model`` hook,
the block-table instance wrappers and the graph ledger all find ``current_draft() is ctx``; a
model runner's hooks find their recorder with ``owner_recorder(runner)`` (its PCP manager's).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["current_draft", "drafting", "warming_up", "warm_up", "recorder_of", "live_recorder", "owner_recorder",
           "attach_runner", "current_session", "swap_session", "session_lock", "close_active_session"]

_tls = threading.local()  # .ctx: the DraftContext of the propose running on this thread
_warmup_depth = 0  # > 0 inside vLLM's Worker.compile_or_warm_up_model (this process)
session_lock = threading.Lock()  # guards _session (sessions.active_session creates the plugin's under it)
_session: Any = None  # the TraceSession this process records into (sessions.py makes it)


def current_draft() -> Any:
    """The ``DraftContext`` of the ``propose`` running on this thread (None outside one)."""
    return getattr(_tls, "ctx", None)


@contextmanager
def drafting(ctx: Any) -> Iterator[None]:
    """``ctx`` is this thread's ``current_draft()`` inside the block (the one before it after)."""
    previous = current_draft()
    _tls.ctx = ctx
    try:
        yield
    finally:
        _tls.ctx = previous


def warming_up() -> bool:
    """True while vLLM warms up before serving: ``Worker.compile_or_warm_up_model`` runs
    synthetic scheduler steps (requests ``_warmup_{i}_``, ``_v2_mixed_warmup_*``; fake draft
    tokens) through ``execute_model`` when it compiles (``cudagraph_mode`` PIECEWISE, JIT warm-up)."""
    return _warmup_depth > 0


@contextmanager
def warm_up() -> Iterator[None]:
    """``warming_up()`` is True inside the block (vLLM's warm-up; nests)."""
    global _warmup_depth
    _warmup_depth += 1
    try:
        yield
    finally:
        _warmup_depth -= 1


def recorder_of(manager: Any) -> Any:
    """The live recorder of a ``RecordingPCPManager`` (None for anything else, and during
    vLLM's warm-up unless the session records dummy runs: ``PCPVIZ_RECORD_DUMMY=1``)."""
    return live_recorder(getattr(manager, "_pcpviz_recorder", None))


def live_recorder(rec: Any) -> Any:
    """``rec`` if it records now (not switched off, not closed, not inside vLLM's warm-up unless
    dummy runs are recorded), else None."""
    if rec is None or rec.disabled or rec.closed or rec.session.mode == "off":
        return None
    if _warmup_depth > 0 and not rec.session.record_dummy:
        return None
    return rec


def owner_recorder(obj: Any) -> Any:
    """The live recorder of a model runner or speculator: its PCP manager's (PCP > 1), else its
    own (PCP = 1: ``attach_runner``)."""
    manager = getattr(obj, "pcp_manager", None)
    return recorder_of(manager) if manager is not None else recorder_of(obj)


def attach_runner(runner: Any, session: Any) -> Any:
    """PCP = 1 (no ``PCPManager``): give ``runner`` and its speculator a recorder of
    ``session`` (rank 0 of 1; None on a TP rank that does not record). The plugin calls it
    when a ``GPUModelRunner`` is built, the CPU replay on its stand-in runner."""
    rec = session.recorder_for_rank(0, 1)
    runner._pcpviz_recorder = rec
    spec = getattr(runner, "speculator", None)
    if spec is not None:
        spec._pcpviz_recorder = rec
    return rec


def current_session() -> Any:
    """The ``TraceSession`` this process records into, if there is one (never makes one)."""
    return _session


def swap_session(s: Any) -> Any:
    """Make ``s`` (a ``TraceSession`` or None) this process's session; returns the one before.
    The caller holds ``session_lock``."""
    global _session
    previous, _session = _session, s
    return previous


def close_active_session(reason: str) -> None:
    """Finalize this process's session, if it has one (``Worker.shutdown``, exit)."""
    with session_lock:
        s = _session
    if s is not None:
        s.close(reason)
