"""Where the recorders of one run write: a ``TraceSession`` (a run directory, one
``TraceWriter`` per PCP rank, ``run.json`` written by PCP rank 0).

The replay opens one explicitly; the plugin's comes from ``$PCPVIZ_TRACE_DIR`` in each vLLM
worker (``active_session``)::

    with recording.session("runs/replay", producer="vllm-replay", strict=True) as s:
        ...                                   # RecordingPCPManagers built here record into s
    # runs/replay/rank0.arrow, rank1.arrow (PCP=2), run.json

Only TP rank 0 records (the other TP ranks hold the same batch views).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pcpviz.vllm.recording.recorder import RankRecorder

__all__ = ["ENV_TRACE_DIR", "ENV_RECORD_DUMMY", "TraceSession", "session", "active_session"]

ENV_TRACE_DIR = "PCPVIZ_TRACE_DIR"
"""Directory the plugin records into (unset or empty: the plugin is inert)."""
ENV_RECORD_DUMMY = "PCPVIZ_RECORD_DUMMY"
"""``1``: the plugin also records dummy/profile runs (phase ``dummy``); default off."""

_session_lock = threading.Lock()
_session: TraceSession | None = None


class TraceSession:
    """Where the recorders of one run write: ``run_dir/rank{pcp_rank}.arrow`` + ``run.json``.

    ``meta``: run.json content (PCP rank 0 writes it at its first step, completed with what
    the recorders learn: pcp, dcp, shard_decode_requests, block_size(s), K, ...).
    ``strict``: re-raise exceptions from hooks (replay) instead of disabling recording
    (plugin). ``record_dummy``: record ``propose(dummy_run=True)`` as a step with phase
    ``dummy``. ``tp_rank``: only this TP rank records (other TP ranks hold the same batch
    views); ``None`` disables the filter.
    """

    def __init__(self, run_dir: str | os.PathLike, *, producer: str, meta: Mapping[str, Any] | None = None,
                 strict: bool = False, record_dummy: bool = True, overwrite: bool = False,
                 tp_rank: int | None = 0) -> None:
        self.run_dir = Path(run_dir)
        self.meta: dict[str, Any] = {"producer": producer, **dict(meta or {})}
        self.strict = strict
        self.record_dummy = record_dummy
        self.overwrite = overwrite
        self.tp_rank = tp_rank
        self.recorders: dict[int, RankRecorder] = {}
        self._lock = threading.Lock()

    def recorder_for(self, manager: Any) -> RankRecorder | None:
        """A recorder for the manager's PCP rank (None on a TP rank that does not record)."""
        if self.tp_rank is not None and _tp_rank() != self.tp_rank:
            return None
        with self._lock:
            rec = RankRecorder(self, manager.pcp_rank, manager.pcp_world_size)
            self.recorders[manager.pcp_rank] = rec
            return rec

    def close(self) -> None:
        """Write every pending step and close the rank files (idempotent)."""
        for rec in list(self.recorders.values()):
            rec.close()

    @property
    def seconds_recording(self) -> float:
        return sum(r.seconds for r in self.recorders.values())


@contextlib.contextmanager
def session(run_dir: str | os.PathLike, **kwargs: Any) -> Iterator[TraceSession]:
    """Make a ``TraceSession`` the active one for the ``RecordingPCPManager``s built inside."""
    global _session
    s = TraceSession(run_dir, **kwargs)
    with _session_lock:
        previous, _session = _session, s
    try:
        yield s
    finally:
        s.close()
        with _session_lock:
            _session = previous


def active_session() -> TraceSession | None:
    """The session a new ``RecordingPCPManager`` records into: the one opened with
    ``session()``, else one made from ``$PCPVIZ_TRACE_DIR`` (the plugin's), else None."""
    global _session
    with _session_lock:
        if _session is None:
            run_dir = os.environ.get(ENV_TRACE_DIR, "").strip()
            if run_dir:
                _session = TraceSession(run_dir, producer="vllm-plugin",
                                        record_dummy=os.environ.get(ENV_RECORD_DUMMY, "") == "1")
                atexit.register(_session.close)
        return _session


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (the CPU replay): TP rank 0
        return 0
