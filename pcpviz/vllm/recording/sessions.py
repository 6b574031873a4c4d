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
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pcpviz.trace.files import RUN_META_FILE
from pcpviz.trace.flight import FlightConfig
from pcpviz.vllm.contract import ENV_TRACE_DIR  # the one definition
from pcpviz.trace.outputs import special_kind
from pcpviz.trace.owner import LOCK_FILE, trace_files, writer_busy
from pcpviz.vllm.recording.recorder import RankRecorder
from pcpviz.vllm.recording.state import close_active_session, current_session, session_lock, swap_session

__all__ = ["ENV_TRACE_DIR", "ENV_RECORD_DUMMY", "TraceSession", "session", "active_session", "current_session",
           "close_active_session"]

ENV_RECORD_DUMMY = "PCPVIZ_RECORD_DUMMY"
"""``1``: the plugin also records dummy/profile runs (phase ``dummy``); default off."""


class TraceSession:
    """Where the recorders of one run write: ``run_dir/rank{pcp_rank}.arrow`` + ``run.json``.

    ``meta``: run.json content (PCP rank 0 writes it at its first step, completed with what
    the recorders learn: pcp, dcp, shard_decode_requests, block_size(s), K, ...).
    ``strict``: re-raise exceptions from hooks (replay) instead of disabling recording
    (plugin). ``record_dummy``: record ``propose(dummy_run=True)`` as a step with phase
    ``dummy``. ``tp_rank``: only this TP rank records (other TP ranks hold the same batch
    views); ``None`` disables the filter. ``flight``: keep the last steps in host memory and
    dump them on a trigger instead of writing every step (the plugin's comes from
    ``PCPVIZ_FLIGHT_RECORDER``).
    """

    def __init__(self, run_dir: str | os.PathLike, *, producer: str, meta: Mapping[str, Any] | None = None,
                 strict: bool = False, record_dummy: bool = True, overwrite: bool = False,
                 tp_rank: int | None = 0, flight: FlightConfig | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.meta: dict[str, Any] = {"producer": producer, **dict(meta or {})}
        self.strict = strict
        self.record_dummy = record_dummy
        self.overwrite = overwrite
        self.tp_rank = tp_rank
        self.recorders: dict[int, RankRecorder] = {}
        self.flight: FlightConfig | None = flight  # flight-recorder mode (pcpviz.trace.flight)
        self.mode = "flight" if flight is not None else "record"  # or "off" (set_mode)
        self._lock = threading.Lock()

    def recorder_for(self, manager: Any) -> RankRecorder | None:
        """A recorder for the manager's PCP rank (None on a TP rank that does not record)."""
        return self.recorder_for_rank(manager.pcp_rank, manager.pcp_world_size)

    def recorder_for_rank(self, pcp_rank: int, pcp_world_size: int) -> RankRecorder | None:
        """A recorder for PCP rank ``pcp_rank`` of ``pcp_world_size`` (PCP = 1: rank 0 of 1, the
        model runner's own); None on a TP rank that does not record."""
        if self.tp_rank is not None and _tp_rank() != self.tp_rank:
            return None
        with self._lock:
            rec = RankRecorder(self, pcp_rank, pcp_world_size)
            self.recorders[pcp_rank] = rec
            return rec

    def close(self, reason: str = "finished") -> None:
        """Write every pending step and finalize the rank files (idempotent)."""
        for rec in list(self.recorders.values()):
            rec.close(reason)

    @property
    def seconds_recording(self) -> float:
        return sum(r.seconds for r in self.recorders.values())


@contextlib.contextmanager
def session(run_dir: str | os.PathLike, **kwargs: Any) -> Iterator[TraceSession]:
    """Make a ``TraceSession`` the active one for the ``RecordingPCPManager``s built inside."""
    s = TraceSession(run_dir, **kwargs)
    with session_lock:
        previous = swap_session(s)
    try:
        yield s
    finally:
        s.close()
        with session_lock:
            swap_session(previous)


def active_session() -> TraceSession | None:
    """The session a new ``RecordingPCPManager`` records into: the one opened with
    ``session()``, else one made from ``$PCPVIZ_TRACE_DIR`` (the plugin's), else None."""
    with session_lock:
        if current_session() is None:
            run_dir = os.environ.get(ENV_TRACE_DIR, "").strip()
            refused = _refused_dir(run_dir) if run_dir else None
            if refused is not None:
                if not _warned:  # once per process: the plugin is off here, vLLM runs on
                    _warned.append(refused)
                    logging.getLogger("vllm.pcpviz").warning(
                        "pcpviz: %s=%s: %s; nothing is being written there (recording is off in this process)",
                        ENV_TRACE_DIR, run_dir, refused)
            elif run_dir:
                made = TraceSession(run_dir, producer="vllm-plugin",
                                    record_dummy=os.environ.get(ENV_RECORD_DUMMY, "") == "1",
                                    flight=_flight_from_env())
                swap_session(made)
                atexit.register(made.close, "finished: process exit")
        return current_session()


_warned: list[str] = []  # the one warning this process gave about $PCPVIZ_TRACE_DIR


def _refused_dir(run_dir: str) -> str | None:
    """Why the plugin cannot record into ``run_dir`` before any step is taken, else None: it
    already holds a trace (a run of its own was never overwritten by the plugin), another run is
    writing there, or its lock file or run.json is a FIFO, device or socket."""
    p = Path(run_dir)
    if not p.exists():
        return None
    if not p.is_dir():
        return "exists and is not a directory"
    for name in (LOCK_FILE, RUN_META_FILE):
        kind = special_kind(p / name) if os.path.lexists(p / name) else None
        if kind is not None or os.path.islink(p / name) and name == LOCK_FILE:
            return f"its {name} is {kind or 'a symbolic link'}, not a regular file"
    busy = writer_busy(p)
    if busy:
        return busy.split(": ", 1)[-1]
    try:
        held = [f.name for f in trace_files(p)]
    except OSError as exc:
        return exc.strerror or str(exc)
    if held:
        return f"already holds a trace ({', '.join(held[:3])}); give a new directory or remove it"
    return None


def _flight_from_env() -> FlightConfig | None:
    """``PCPVIZ_FLIGHT_*`` (docs/gpu.md); a bad value is one warning and full recording."""
    try:
        return FlightConfig.from_env()
    except ValueError as exc:
        logging.getLogger("vllm.pcpviz").warning("pcpviz: %s; recording every step instead", exc)
        return None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (the CPU replay): TP rank 0
        return 0
