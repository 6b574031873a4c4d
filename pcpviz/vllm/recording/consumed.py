"""What a draft forward consumed, beside what the speculator prepared.

The prepared views of a draft phase (``draft_input_ids``, ``draft_positions``, ...) are read from
the buffers the speculator filled, when ``_run_model`` is entered. A bug between that point and
the model (a shifted positions view handed to RoPE, the wrong batch's buffers) leaves them right
and the forward wrong. The ``fwd_*`` views are read where the model gets its inputs:

=====================  =======================================================================
``fwd_source``         where the ``fwd_*`` views were read (str scalar):
``model_call``         the arguments of the draft model's call (``type(spec.model).__call__``,
                       eager and PIECEWISE), and the forward context's slot mapping at that call
``graph_capture``      a FULL CUDA-graph replay: the tensors the model was handed when that graph
                       was captured (noted at capture, ``CudaGraphManager.capture``), read right
                       before the replay: the buffers the graph's kernels read by address
``graph_buffers``      a FULL replay whose capture was not observed: the speculator's own
                       buffers, which ``_run_model`` hands the model at capture time
                       (``draft_prefill_batch`` is None then), read right before the replay
=====================  =======================================================================

Views (PCP=1, K=2, two decodes of 1 + 2 tokens; draft_0 runs on T = 6 rows)::

    draft_0  draft_positions [20 21 22 40 41 42]   (prepared)
             fwd_positions   [20 21 22 40 41 42]   (the model's positions argument)
             fwd_input_ids   int32[6], fwd_slot_mapping int64[G, 6], fwd_hidden_fp (fingerprints)

The check ``forward_consumed_prepared`` (``pcpviz.analysis.checks.consumed_checks``) compares them.
Inside a FULL replay nothing of vLLM runs in Python; the CPU replay's stand-in graphs do run
Python, and ``in_full_replay()`` keeps the recording hooks out of it as on a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pcpviz.vllm.recording.host import Deferred, Fresh, fingerprint_view

__all__ = ["in_full_replay", "full_replay", "capturing", "capturing_now", "note_capture", "captured_inputs",
           "model_call_views", "model_inputs", "SOURCES"]

SOURCES = ("model_call", "graph_capture", "graph_buffers")
_tls = threading.local()  # .full: inside a FULL replay; .manager: the graph manager capturing
_CAPTURED: dict[tuple[int, int], dict[str, Any]] = {}  # (id(graph manager), num_tokens) -> tensors handed at capture
_lock = threading.Lock()


def in_full_replay() -> bool:
    """True inside a FULL CUDA-graph replay on this thread (the hooks record nothing there)."""
    return bool(getattr(_tls, "full", False))


@contextlib.contextmanager
def full_replay() -> Iterator[None]:
    prev = in_full_replay()
    _tls.full = True
    try:
        yield
    finally:
        _tls.full = prev


@contextlib.contextmanager
def capturing(manager: Any) -> Iterator[None]:
    """``CudaGraphManager.capture`` of ``manager`` runs on this thread."""
    prev = getattr(_tls, "manager", None)
    _tls.manager = manager
    try:
        yield
    finally:
        _tls.manager = prev


def capturing_now() -> bool:
    """A speculator graph manager captures on this thread (``capturing``)."""
    return getattr(_tls, "manager", None) is not None


def model_inputs(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """``(input_ids, positions, hidden_states)`` of a draft model call (``forward(input_ids,
    positions, hidden_states, ...)``, by keyword as ``_run_model`` calls it, or by position)."""
    def pick(i: int, name: str) -> Any:
        return kwargs[name] if name in kwargs else (args[i] if len(args) > i else None)

    return pick(0, "input_ids"), pick(1, "positions"), pick(2, "hidden_states")


def note_capture(args: tuple, kwargs: dict, slot_mapping: Any) -> None:
    """A model call while a graph manager captures: remember the tensors it was handed (views of
    persistent buffers, the addresses the captured kernels read) for that manager's replays."""
    manager = getattr(_tls, "manager", None)
    if manager is None:
        return
    ids, pos, hidden = model_inputs(args, kwargs)
    if not isinstance(pos, torch.Tensor):
        return
    with _lock:
        _CAPTURED[(id(manager), int(pos.shape[0]))] = {"input_ids": ids, "positions": pos, "hidden_states": hidden,
                                                       "slot_mapping": slot_mapping}


def captured_inputs(manager: Any, num_tokens: int) -> dict[str, Any] | None:
    with _lock:
        return _CAPTURED.get((id(manager), int(num_tokens)))


def _fp(t: Any) -> Deferred | Fresh | None:
    return fingerprint_view(t)


def model_call_views(ids: Any, pos: Any, hidden: Any, *, slots: Any, source: str, rows: int | None = None) -> dict:
    """The ``fwd_*`` views of one forward's inputs (the first ``rows`` rows, all by default)."""
    n = rows if rows is not None else (int(pos.shape[0]) if isinstance(pos, torch.Tensor) else None)
    views: dict[str, Any] = {"fwd_source": np.array(source)}
    if isinstance(ids, torch.Tensor):
        views["fwd_input_ids"] = ids[:n]
    if isinstance(pos, torch.Tensor):
        views["fwd_positions"] = pos[:n]
    fp = _fp(hidden[:n] if isinstance(hidden, torch.Tensor) else None)
    if fp is not None:
        views["fwd_hidden_fp"] = fp
    if slots is not None:
        views["fwd_slot_mapping"] = slots
    return views
