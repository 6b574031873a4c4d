"""Where a step's time goes: named, nested phases timed from the engine loop itself.

Off by default, and then free: ``PhaseTimer(enabled=False).phase(name)`` hands back one shared
no-op context manager, nothing is recorded and no device event is created.

On, the loop is cut at every phase boundary. The time between two consecutive boundaries goes
to the innermost open phase (``other`` when none is open), so the phases of a step *partition*
its time: their sum is the step's time, and the steps' sum is at most the loop's. A nested
phase is exclusive (the all-gathers inside the target forward are counted in ``gather``, not
in ``target``). Two clocks:

* ``host_ms``   ``time.perf_counter`` on the CPU (always);
* ``device_ms`` CUDA events recorded at the same boundaries (CUDA only): the device timeline,
                idle gaps included, so a launch-bound phase shows ``device_ms ~ host_ms``.
                The events are read once, at ``summary()`` (no sync inside a step).

Worked example (PCP=2, K=2, one decode step; times in ms, host clock)::

    step ├ schedule 0.05 ┤ batch 0.20 ├ h2d 0.02 ┤ target 0.50 [gather 0.08] ┤ verify 0.03 ┤ ...
    summary()["decode"]["phases"]["target"]["host_ms"] == 0.42   (0.50 less the nested gather)

Phase names the engine times are ``TIMED_PHASES`` (not the trace's phases,
``pcpviz.trace.phases.PHASES``); ``summary()`` lists every one of them (zero when a configuration
never enters it, e.g. ``draft_1`` at K=1), grouped by step kind: ``all`` steps and ``decode``
steps only (no prefill row), each with ``steps``, ``step_ms`` (the sum of the steps' times) and per
phase ``host_ms`` / ``device_ms`` summed over the steps (``per_step`` divides by ``steps``).
"""

from __future__ import annotations

import contextlib
import time

__all__ = ["PhaseTimer", "TIMED_PHASES"]

TIMED_PHASES = (
    "schedule",  # rank 0's scheduler, the plan's broadcast (PCP > 1: also the wait for the
    #              slowest rank to reach it), applying the verdict (host)
    "batch",  # global batch, PCP layout, rank-local batch, slot mappings (host)
    "h2d",  # packing the step's inputs and copying them to the device
    "target",  # the target forward, logits and the sampled tokens' copy to the host
    "gather",  # all-gathers (KV latents, hidden states) and the draft block-table gather
    #            (inside a replayed CUDA graph they count in the graph's phase)
    "verify",  # greedy verification (host)
    "draft_0",  # the draft prefill (MTP layer on the rank-local rows)
    "draft_k",  # the replicated draft decodes 1..K-1, and the next step's wait for the drafts'
    #             copy to the host (draft_0 when K = 1)
    "record",  # assembling the step's trace record and handing it to the writer
    "capture",  # capturing a CUDA graph (first use of a decode shape; warm-up run included)
    "other",  # time inside a step outside every phase
)

_NULL = contextlib.nullcontext()


class PhaseTimer:
    """``timer.phase(name)`` context managers inside ``timer.step()`` ones (see the module)."""

    def __init__(self, enabled: bool = False, device=None) -> None:
        self.enabled = bool(enabled)
        self._cuda = bool(enabled and device is not None and getattr(device, "type", "") == "cuda")
        self._stack: list[str] = []
        self._marks: list[tuple[int, object, str | None]] = []  # (ns, event, phase of next segment)
        self._steps: list[tuple[str, list]] = []  # (kind, marks of the step)
        self._in_step = False
        self.suspended = False  # set while a CUDA graph is captured: no marks, no events
        self.labels = False  # also open a torch.profiler range "phase:<name>" (pcpviz.engine.profile)

    def __bool__(self) -> bool:
        return self.enabled

    # ---------------------------------------------------------------- recording
    def _mark(self, top: str | None) -> None:
        ev = None
        if self._cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self._marks.append((time.perf_counter_ns(), ev, top))

    def phase(self, name: str):
        """A context manager timing ``name`` (one of ``TIMED_PHASES``); a no-op when off."""
        if not self.enabled or not self._in_step or self.suspended:
            return _NULL
        if name not in TIMED_PHASES:
            raise ValueError(f"unknown phase {name!r} (known: {', '.join(TIMED_PHASES)})")
        return self._phase(name)

    @contextlib.contextmanager
    def _phase(self, name: str):
        self._stack.append(name)
        self._mark(name)
        label = None
        if self.labels:
            import torch.profiler

            label = torch.profiler.record_function(f"phase:{name}")
            label.__enter__()
        try:
            yield
        finally:
            if label is not None:
                label.__exit__(None, None, None)
            self._stack.pop()
            self._mark(self._stack[-1] if self._stack else None)

    def step(self):
        """A context manager around one engine step; yields a dict whose ``"kind"`` the step
        sets (``"decode"`` or ``"prefill"``; default ``"prefill"``; None: not a step, dropped)."""
        if not self.enabled:
            return contextlib.nullcontext({})
        return self._step()

    @contextlib.contextmanager
    def _step(self):
        info = {"kind": "prefill"}
        self._marks = []
        self._in_step = True
        self._mark(None)
        try:
            yield info
        finally:
            self._in_step = False
            self._mark(None)
            if info["kind"] is not None:
                self._steps.append((info["kind"], self._marks))
            self._marks = []

    # ---------------------------------------------------------------- reading
    def summary(self) -> dict:
        """``{"all": {...}, "decode": {...}}`` (see the module docstring); ``{}`` when off.
        Waits for the device once (the last event) when CUDA events were recorded."""
        if not self.enabled:
            return {}
        if self._cuda and self._steps:
            self._steps[-1][1][-1][1].synchronize()
        out = {}
        for kind in ("all", "decode"):
            steps = [m for k, m in self._steps if kind == "all" or k == kind]
            host = dict.fromkeys(TIMED_PHASES, 0.0)
            dev = dict.fromkeys(TIMED_PHASES, 0.0) if self._cuda else None
            step_ms = 0.0
            for marks in steps:
                step_ms += (marks[-1][0] - marks[0][0]) / 1e6
                for (t0, e0, top), (t1, e1, _) in zip(marks[:-1], marks[1:]):
                    name = top or "other"
                    host[name] += (t1 - t0) / 1e6
                    if dev is not None:
                        dev[name] += e0.elapsed_time(e1)
            n = len(steps)
            out[kind] = {
                "steps": n,
                "step_ms": step_ms,
                "phases": {p: {"host_ms": host[p], **({"device_ms": dev[p]} if dev is not None else {})}
                           for p in TIMED_PHASES},
                "per_step": {p: {"host_ms": host[p] / n if n else 0.0,
                                 **({"device_ms": dev[p] / n if n else 0.0} if dev is not None else {})}
                             for p in TIMED_PHASES},
            }
        return out
