"""Flight-recorder mode: keep the last N steps of a rank in host memory, write nothing while the
run is healthy, and dump them as a normal trace when something goes wrong.

Both producers use it (the engine's ranks, the vLLM plugin's recorders): a ``FlightRing`` takes
the writer's place (``write_step``, ``close``), so a step costs what recording costs up to the
host copy and nothing on disk. Configured by environment variables (``FlightConfig.from_env``;
docs/gpu.md lists them with the plugin's):

=================================  =============================================================
``PCPVIZ_FLIGHT_RECORDER=N``       on, keeping the last N steps per rank (unset or 0: off)
``PCPVIZ_FLIGHT_ACCEPTANCE=0.3``   dump when the acceptance rate over the window falls below it
``PCPVIZ_FLIGHT_WINDOW=32``        steps with drafts in that window (default ``min(N, 32)``)
``PCPVIZ_FLIGHT_SIGNAL=SIGUSR1``   dump on this signal (``none``: no signal); send it to every rank
``PCPVIZ_FLIGHT_MAX_MB=256``       host memory of one rank's ring: older steps go first (one warning)
``PCPVIZ_FLIGHT_MAX_DUMPS=8``      dumps per rank and run, then one warning and no more
=================================  =============================================================

A dump also happens when a step raises (the producer calls ``close(status="partial", ...)``
or ``dump("exception: ...")``) and at shutdown (``close()``). Each dump is a directory beside the
others, ``<trace dir>/flight-000-acceptance/``, holding run.json (the run's keys plus
``flight_recorder``: trigger, steps kept, threshold, window), one rank file per rank (each rank
dumps the same steps when the trigger is global: acceptance, shutdown) and ``complete.json``
(reason ``flight recorder: <trigger>``). PCP=2, N=64, acceptance 0.3 over 32 steps: a run whose
rate drops to 0.21 at step 900 leaves ``flight-000-acceptance/`` holding steps 837-900.
"""

from __future__ import annotations

import logging
import os
import re
import signal as signals
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .meta_model import meta_document

__all__ = ["FlightConfig", "FlightRing", "ENV_VARS", "step_bytes"]

logger = logging.getLogger("pcpviz.flight")

ENV_VARS = {
    "PCPVIZ_FLIGHT_RECORDER": "flight-recorder mode, keeping the last N steps per rank (unset or 0: off)",
    "PCPVIZ_FLIGHT_ACCEPTANCE": "dump when the acceptance rate over the window falls below this (0..1; "
                                "default 0: never)",
    "PCPVIZ_FLIGHT_WINDOW": "steps with drafts the acceptance rate is taken over (default min(N, 32))",
    "PCPVIZ_FLIGHT_SIGNAL": "dump on this signal (default SIGUSR1; none: no signal)",
    "PCPVIZ_FLIGHT_MAX_MB": "host memory one rank's ring may hold, in MB (default 256)",
    "PCPVIZ_FLIGHT_MAX_DUMPS": "dumps per rank and run (default 8)",
}
"""The environment variables -> meaning (docs)."""


def _num(env: Mapping[str, str], key: str, kind: type, default: Any, lo: float, hi: float) -> Any:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r}: expected {'an integer' if kind is int else 'a number'}") from None
    if not lo <= value <= hi:
        raise ValueError(f"{key}={raw!r}: expected a value in {lo:g}..{hi:g}")
    return value


@dataclass(frozen=True)
class FlightConfig:
    """What the flight recorder keeps and when it dumps (see the module doc)."""

    steps: int
    acceptance: float = 0.0
    window: int = 32
    signal: int | None = signals.SIGUSR1
    max_bytes: int = 256 << 20
    max_dumps: int = 8

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "FlightConfig | None":
        """None when ``PCPVIZ_FLIGHT_RECORDER`` is unset or 0; ValueError (one line naming the
        variable) for a bad value."""
        env = os.environ if env is None else env
        steps = _num(env, "PCPVIZ_FLIGHT_RECORDER", int, 0, 0, 1 << 20)
        if not steps:
            return None
        sig_name = env.get("PCPVIZ_FLIGHT_SIGNAL", "SIGUSR1").strip() or "SIGUSR1"
        if sig_name.lower() == "none":
            sig = None
        else:
            try:
                sig = int(signals.Signals[sig_name.upper() if sig_name.upper().startswith("SIG")
                                          else "SIG" + sig_name.upper()])
            except KeyError:
                raise ValueError(f"PCPVIZ_FLIGHT_SIGNAL={sig_name!r}: not a signal name (SIGUSR1, SIGUSR2, none)") \
                    from None
        return cls(steps=steps, acceptance=_num(env, "PCPVIZ_FLIGHT_ACCEPTANCE", float, 0.0, 0.0, 1.0),
                   window=_num(env, "PCPVIZ_FLIGHT_WINDOW", int, min(steps, 32), 1, 1 << 20), signal=sig,
                   max_bytes=int(_num(env, "PCPVIZ_FLIGHT_MAX_MB", float, 256.0, 0.001, 1 << 20) * (1 << 20)),
                   max_dumps=_num(env, "PCPVIZ_FLIGHT_MAX_DUMPS", int, 8, 0, 10_000))

    def to_meta(self) -> dict[str, Any]:
        return {"steps_kept": self.steps, "acceptance_threshold": self.acceptance, "window": self.window,
                "signal": None if self.signal is None else signals.Signals(self.signal).name}


def step_bytes(phases: Mapping[str, Mapping[str, Any]]) -> int:
    """Host bytes of one step's views (NumPy arrays; strings by their characters)."""
    return sum(int(np.asarray(v).nbytes) for views in phases.values() for v in views.values())


class FlightRing:
    """One rank's last N steps, in the place of its ``TraceWriter`` (``write_step``, ``close``).

    ``meta``: a callable giving run.json's keys at dump time (rank 0 writes run.json). Dumps go
    to ``run_dir/flight-<seq>-<trigger>/``. ``catch_signal``: install the dump signal's handler
    (main thread only; the dump itself runs on a helper thread, never inside the handler).
    """

    def __init__(self, config: FlightConfig, run_dir: str | os.PathLike, rank: int,
                 meta: Callable[[], Mapping[str, Any]], *, catch_signal: bool = True,
                 log: logging.Logger | None = None) -> None:
        self.config, self.run_dir, self.rank, self.meta = config, Path(run_dir), int(rank), meta
        self.log = log or logger
        self.path = self.run_dir / f"(flight recorder of rank {rank})"
        self.ring: deque[tuple[int, dict, int]] = deque()
        self.bytes = 0
        self.dumps: list[Path] = []
        self.closed = False
        self._window: deque[tuple[int, int]] = deque(maxlen=config.window)  # (accepted, drafted) per step
        self._cooldown = 0
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        if catch_signal and config.signal is not None and threading.current_thread() is threading.main_thread():
            signals.signal(config.signal, lambda *_: self._wake.set())
            threading.Thread(target=self._signal_loop, name="pcpviz-flight-signal", daemon=True).start()

    # ---------------------------------------------------------------- the writer interface
    def write_step(self, step: int, phases: dict) -> None:
        """Keep a step (host NumPy views); dump if the acceptance window falls below the threshold."""
        n = step_bytes(phases)
        with self._lock:
            self.ring.append((int(step), phases, n))
            self.bytes += n
            while len(self.ring) > self.config.steps or (self.bytes > self.config.max_bytes and len(self.ring) > 1):
                capped = len(self.ring) <= self.config.steps
                self.bytes -= self.ring.popleft()[2]
                if capped:
                    self._warn_once("cap", f"pcpviz flight recorder: rank {self.rank}: PCPVIZ_FLIGHT_MAX_MB="
                                    f"{self.config.max_bytes / (1 << 20):g} keeps {len(self.ring)} of the "
                                    f"{self.config.steps} steps asked for ({n / 1e6:.2f} MB a step)")
            trigger = self._acceptance_trigger(phases)
        if trigger:
            self.dump(trigger)

    def close(self, *, status: str = "complete", reason: str = "finished") -> None:
        """The end of the run: dump the ring (trigger ``shutdown``, or the exception for a run
        that ended ``partial``). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.dump("shutdown" if status == "complete" else reason if reason.startswith("stopped")
                  else f"exception: {reason}")

    # ---------------------------------------------------------------- triggers and dumps
    def _acceptance_trigger(self, phases: Mapping[str, Mapping[str, Any]]) -> str | None:
        if self.config.acceptance <= 0:
            return None
        verify = phases.get("verify", {})
        acc, drafted = verify.get("num_accepted"), verify.get("num_draft_tokens")
        if acc is None or drafted is None:
            return None
        a, d = int(np.asarray(acc).sum()), int(np.asarray(drafted).sum())
        if d == 0:
            return None
        self._window.append((a, d))
        if self._cooldown:
            self._cooldown -= 1
            return None
        if len(self._window) < self.config.window:
            return None
        rate = sum(x for x, _ in self._window) / sum(y for _, y in self._window)
        if rate >= self.config.acceptance:
            return None
        self._cooldown = self.config.window
        return f"acceptance {rate:.3f} < {self.config.acceptance:g} over {self.config.window} steps"

    def _signal_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self.closed:
                return
            self.dump(f"signal {signals.Signals(self.config.signal).name}")

    def dump(self, trigger: str) -> Path | None:
        """Write the ring as a normal trace into the next ``flight-<seq>-<kind>`` directory; the
        directory (None when the ring is empty or the dump budget is spent)."""
        from .writer import TraceWriter

        with self._lock:
            steps = list(self.ring)
            if not steps:
                return None
            if len(self.dumps) >= self.config.max_dumps:
                self._warn_once("dumps", f"pcpviz flight recorder: rank {self.rank}: {self.config.max_dumps} dumps "
                                "written (PCPVIZ_FLIGHT_MAX_DUMPS); no more")
                return None
            kind = re.sub(r"[^a-z]+", "-", trigger.split(":")[0].split(" ")[0].lower()).strip("-") or "dump"
            out = self.run_dir / f"flight-{len(self.dumps):03d}-{kind}"
            self.dumps.append(out)
        meta = None
        if self.rank == 0:
            meta = {**meta_document(self.meta()), "flight_recorder": {**self.config.to_meta(), "trigger": trigger,
                                                       "steps": [steps[0][0], steps[-1][0]]}}
            meta.pop("num_steps", None)
        try:
            with TraceWriter(out, self.rank, meta=meta) as w:
                for step, phases, _ in steps:
                    w.write_step(step, phases)
                w.close(reason=f"flight recorder: {trigger}")
        except (OSError, ValueError) as exc:
            self.log.warning("pcpviz flight recorder: rank %d: cannot dump to %s: %s", self.rank, out, exc)
            return None
        self.log.warning("pcpviz flight recorder: rank %d dumped steps %d-%d to %s (%s)", self.rank, steps[0][0],
                       steps[-1][0], out, trigger)
        return out

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)
