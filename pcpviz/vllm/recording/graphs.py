"""The graph-replay ledger: which input tensors each CUDA graph was captured on, and which the
caller hands it at every replay.

A CUDA graph replays the kernels it captured on the *addresses* it captured them with; the
tensors passed at replay are not read. vLLM's ``CUDAGraphWrapper`` (a piece of a PIECEWISE
graph) therefore needs every caller to hand it its capture-time buffers, and checks that only
under ``VLLM_LOGGING_LEVEL=DEBUG``. Under PCP, ``PCPManager.get_draft_input_buffers`` hands the
drafter's prefill graph the rank-local batch's buffers instead: the replay reads the global ids
(docs/findings/piecewise-draft-prefill.md) while the recording, which sees the handed buffers,
looks right. The ledger closes that gap, cheaply:

* **capture** (``CUDAGraphWrapper.__call__`` that creates a graph): the address, shape and dtype
  of every tensor argument, per graph key (the wrapper, its mode and ``num_tokens``);
* **replay**: the handed addresses against the captured ones (a list comparison, no sync); a
  difference becomes one line in the phase it happened in, e.g.::

      graph PIECEWISE#3 num_tokens=120 (draft_0): input 0 int32[120] handed at 0x7f2a1c000400,
      captured at 0x7f2a1bfe6400 int32[120]

  and every phase that replayed a graph records ``graph_replays`` (pieces replayed) and
  ``graph_full_replays`` (FULL graphs, ``CudaGraphManager.run_fullgraph``: nothing is handed to
  those, they read their buffers by construction), so the check ``graph_inputs_are_captured``
  can tell "no moved input" from "not observed".

Only while a recording session exists (``install_graph_wrappers`` is called by the plugin and
is inert without a live recorder). FULL graphs run no Python at replay, so their inputs cannot be
compared; a draft forward replayed as a FULL graph is recorded with ``graph_mode`` ``FULL``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pcpviz.trace.packed import host_entry, int64_entry
from pcpviz.vllm.recording.consumed import capturing, full_replay, in_full_replay
from pcpviz.vllm.recording.patching import install_model_wrapper
from pcpviz.vllm.recording.state import current_draft, current_session, live_recorder

__all__ = ["GraphLedger", "LEDGER", "wrap_graph_call", "wrap_run_fullgraph", "graph_targets",
           "install_graph_wrappers", "ledger_views"]

_MAX_LINES = 64  # moved-input lines kept per phase of a step


class GraphLedger:
    """The process's captures (graph key -> inputs) and, per recorder, the replays of the step
    being recorded (phase -> replays, full replays, moved-input lines)."""

    def __init__(self) -> None:
        self.captured: dict[tuple[int, Any], tuple[str, list[tuple[int, tuple[int, ...], str]]]] = {}
        self.labels: dict[int, str] = {}  # id(wrapper) -> "PIECEWISE#3"
        self.captures = 0
        self._lock = threading.Lock()

    def label(self, wrapper: Any) -> str:
        with self._lock:
            key = id(wrapper)
            if key not in self.labels:
                mode = getattr(getattr(wrapper, "runtime_mode", None), "name", "?")
                self.labels[key] = f"{mode}#{len(self.labels)}"
            return self.labels[key]

    def on_capture(self, wrapper: Any, bd: Any, args: tuple) -> None:
        inputs = [(x.data_ptr(), tuple(x.shape), str(x.dtype).removeprefix("torch."))
                  for x in args if isinstance(x, torch.Tensor)]
        name = f"graph {self.label(wrapper)} num_tokens={getattr(bd, 'num_tokens', bd)}"
        self.captured[(id(wrapper), bd)] = (name, inputs)
        self.captures += 1

    def on_replay(self, wrapper: Any, bd: Any, args: tuple, *, rec: Any, phase: str) -> None:
        got = self.captured.get((id(wrapper), bd))
        notes = rec.graph_notes.setdefault(phase, [0, 0, []])
        notes[0] += 1
        if got is None:  # captured before the ledger was installed: nothing to compare with
            return
        name, want = got
        tensors = [x for x in args if isinstance(x, torch.Tensor)]
        if len(tensors) == len(want) and all(t.data_ptr() == w[0] for t, w in zip(tensors, want)):
            return
        lines = notes[2]
        for i, t in enumerate(tensors):
            w = want[i] if i < len(want) else None
            if w is not None and t.data_ptr() == w[0]:
                continue
            if len(lines) >= _MAX_LINES:
                break
            handed = f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]"
            cap = "nothing (more inputs than at capture)" if w is None else \
                f"0x{w[0]:x} {w[2]}[{','.join(map(str, w[1]))}]"
            lines.append(f"{name} ({phase}): input {i} {handed} handed at 0x{t.data_ptr():x}, captured at {cap}")
        if len(tensors) < len(want) and len(lines) < _MAX_LINES:
            lines.append(f"{name} ({phase}): {len(tensors)} tensor inputs handed, {len(want)} captured")

    def on_full_replay(self, rec: Any, phase: str) -> None:
        rec.graph_notes.setdefault(phase, [0, 0, []])[1] += 1


LEDGER = GraphLedger()


def _phase(full: bool = False) -> str:
    """The phase a replay belongs to: the draft forward running (a FULL replay inside ``propose``
    runs no ``_run_model``: the next draft phase), else the target."""
    ctx = current_draft()
    if ctx is None or ctx.dummy:
        return "target"
    if full:  # the draft forward this replay is (DraftContext.on_full_replay appends its phase)
        ctx.full_replays += 1
        return f"draft_{min(len(ctx.phases), max(ctx.k - 1, 0))}"
    return ctx.phases[-1] if ctx.phases else "draft_0"


def _live_recorder() -> Any:
    """The recorder of the step being recorded in this process (None: nothing to attribute to)."""
    s = current_session()
    if s is None:
        return None
    for rec in list(s.recorders.values()):
        if rec.phases is not None and live_recorder(rec) is not None:
            return rec
    return None


def wrap_graph_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """``CUDAGraphWrapper.__call__``: note captures and compare replays (see the module doc).
    The capture-or-replay decision is read from the wrapper's own entries before the call."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    @functools.wraps(original)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return original(self, *args, **kwargs)
        fc = get_forward_context()
        mode, bd = fc.cudagraph_runtime_mode, fc.batch_descriptor
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode or bd is None:
            return original(self, *args, **kwargs)
        entry = self.concrete_cudagraph_entries.get(bd)
        capturing = entry is None or entry.cudagraph is None
        out = original(self, *args, **kwargs)
        try:
            if capturing:
                LEDGER.on_capture(self, bd, args)
            else:
                rec = _live_recorder()
                if rec is not None:
                    rec.guard(LEDGER.on_replay, self, bd, args, rec=rec, phase=_phase())
        except Exception:  # noqa: BLE001 - the ledger never breaks a forward
            pass
        return out

    __call__._pcpviz_wrapper = True  # type: ignore[attr-defined]
    __call__._pcpviz_original = original  # type: ignore[attr-defined]
    return __call__


def wrap_run_fullgraph(original: Callable[..., Any]) -> Callable[..., Any]:
    """``CudaGraphManager.run_fullgraph``: count FULL replays in the phase they happen in; a
    draft forward's replay records its phase from the buffers the graph reads
    (``DraftContext.on_full_replay``), before the replay. Nothing records inside the replay
    (``consumed.full_replay``: the CPU replay's stand-in graphs run Python there)."""
    @functools.wraps(original)
    def run_fullgraph(self, desc: Any, *args: Any, **kwargs: Any) -> Any:
        if in_full_replay():
            return original(self, desc, *args, **kwargs)
        rec = _live_recorder()
        if rec is not None:
            rec.guard(LEDGER.on_full_replay, rec, _phase(full=True))
            ctx = current_draft()
            spec = getattr(ctx, "spec", None)
            if ctx is not None and not ctx.dummy and self in (getattr(spec, "prefill_cudagraph_manager", None),
                                                              getattr(spec, "decode_cudagraph_manager", None)):
                rec.guard(ctx.on_full_replay, self, desc)
        with full_replay():
            return original(self, desc, *args, **kwargs)

    run_fullgraph._pcpviz_wrapper = True  # type: ignore[attr-defined]
    run_fullgraph._pcpviz_original = original  # type: ignore[attr-defined]
    return run_fullgraph


def wrap_spec_capture(original: Callable[..., Any]) -> Callable[..., Any]:
    """``SpeculatorCudaGraphManager.capture(forward_fn, ...)``: the drafter's model calls while it
    captures are noted (``consumed.note_capture``: the tensors each graph reads at replay); the
    model class is wrapped first (``patching.install_model_wrapper``)."""
    @functools.wraps(original)
    def capture(self, *args: Any, **kwargs: Any) -> Any:
        forward_fn = args[0] if args else kwargs.get("forward_fn")
        model = getattr(getattr(forward_fn, "__self__", None), "model", None)
        if isinstance(model, torch.nn.Module):
            try:
                install_model_wrapper(model)
            except Exception:  # noqa: BLE001 - never break vLLM's capture: the replays read "graph_buffers"
                pass
        with capturing(self):
            return original(self, *args, **kwargs)

    capture._pcpviz_wrapper = True  # type: ignore[attr-defined]
    capture._pcpviz_original = original  # type: ignore[attr-defined]
    return capture


def graph_targets() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """``(owner, attribute, wrapper factory)`` the ledger patches."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

    return [(CUDAGraphWrapper, "__call__", wrap_graph_call), (CudaGraphManager, "run_fullgraph", wrap_run_fullgraph),
            (SpeculatorCudaGraphManager, "capture", wrap_spec_capture)]


def install_graph_wrappers() -> None:
    """Patch the targets once (idempotent; ``recording.uninstall_wrappers`` restores them)."""
    for owner, name, factory in graph_targets():
        current = getattr(owner, name)
        if not getattr(current, "_pcpviz_wrapper", False):
            setattr(owner, name, factory(current))


_COUNTS: dict[int, tuple] = {}


def _count(n: int) -> tuple:
    """The entry of ``n`` as an int64 scalar (``pcpviz.trace.packed.host_entry``), one per value:
    entries are immutable, and every step that replayed as many graphs shares it."""
    e = _COUNTS.get(n)
    if e is None:
        e = int64_entry(n)
        if len(_COUNTS) < 1024:
            _COUNTS[n] = e
    return e


def ledger_views(notes: dict[str, list]) -> dict[str, dict[str, Any]]:
    """A step's ledger notes as view entries per phase (``pcpviz.trace.packed.host_entry``):
    ``graph_replays``, ``graph_full_replays`` (int64 scalars) and, when an input moved,
    ``graph_inputs_moved`` (str[M])."""
    out: dict[str, dict[str, Any]] = {}
    for phase, (replays, full, lines) in notes.items():
        views: dict[str, Any] = {"graph_replays": _count(replays), "graph_full_replays": _count(full)}
        if lines:
            views["graph_inputs_moved"] = host_entry(np.array(lines, dtype=str))
        out[phase] = views
    return out
