"""Opt-in fixes for the vLLM 0.33.0 findings in ``docs/findings/``, each the fix its finding proposes.

Named in the environment variable ``PCPVIZ_FIXES`` (comma-separated; ``all`` for every one), read
by the plugin when it installs (``pcpviz.vllm.plugin``) and by the CPU replay for each run
(``pcpviz.vllm.replay``)::

    PCPVIZ_FIXES=piecewise_draft_prefill vllm serve ...       # the plugin patches vLLM's classes
    PCPVIZ_FIXES=piecewise_draft_prefill pcpviz replay --graph-mode PIECEWISE ...

Each fix patches one method of vLLM's classes where the finding places the fix; nothing else
changes. The same checks run on a trace recorded with a fix on, and the replay's test holds that
acceptance returns to the eager figure:

==================================  =====================================================
``piecewise_draft_prefill``         piecewise-draft-prefill.md: copy the rank-local ids and positions
                                    into the speculator's own buffers (the ones its draft-prefill graph
                                    was captured with) when ``get_draft_input_buffers`` hands
                                    ``_run_model`` the rank-local batch, and the global rows back in
                                    ``restore_draft_prefill`` (the finding's ``copy_in_run_model``)
``full_draft_prefill_state``        full-draft-prefill-state.md: dispatch the draft prefill eagerly
                                    while the PCP manager's ``draft_prefill_batch`` is set (the finding's
                                    ``eager_prefill_under_pcp``; removes the PIECEWISE cause too)
``dspark_dummy_run_block_tables``   dspark-dummy-run-stale-block-tables.md: ``PCPManager.
                                    get_dummy_block_tables`` also zeroes ``BlockTables.
                                    input_block_tables`` (``zero_input_block_tables``)
==================================  =====================================================

PCP=2, draft prefill of a 13-token prompt under PIECEWISE: rank 1 is handed its 6 local rows
(positions 3..6, 7..8 after DualChunkSwap) in the local batch, while its graph reads rows 0..5 of the
speculator's buffers (the global shifted ids, positions 0..5). With ``piecewise_draft_prefill`` those
six rows are the local rows when the graph reads them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm.config import CUDAGraphMode

from pcpviz.vllm.contract import ENV_FIXES
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.pcp_manager import PCPManager
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

__all__ = ["ENV", "Fix", "FIXES", "requested", "applied", "apply_from_env", "active"]

ENV = ENV_FIXES  # the variable's one definition is pcpviz.vllm.contract


@dataclass(frozen=True)
class Fix:
    name: str
    finding: str  # docs/findings/<file>
    description: str
    patches: tuple[tuple[type, str], ...]  # (class, method) it replaces
    make: Callable[[dict[tuple[type, str], Any]], dict[tuple[type, str], Any]]  # originals -> replacements


def _copy_local_rows(orig: dict) -> dict:
    """Copy the rank-local rows in for the draft prefill's forward; put the global rows back when
    ``restore_draft_prefill`` runs right after it, so every later read (and the next step's
    stale rows) sees the buffers as vLLM left them."""
    get_buffers = orig[(PCPManager, "get_draft_input_buffers")]
    restore = orig[(PCPManager, "restore_draft_prefill")]

    def get_draft_input_buffers(self: PCPManager, input_buffers: Any, num_tokens: int) -> Any:
        handed, is_padding = get_buffers(self, input_buffers, num_tokens)
        if handed is input_buffers:
            return handed, is_padding
        n = min(int(num_tokens), handed.input_ids.shape[0])  # int: rows the local batch holds
        self._pcpviz_global_rows = (input_buffers, n, input_buffers.input_ids[:n].clone(),
                                    input_buffers.positions[:n].clone())
        input_buffers.input_ids[:n].copy_(handed.input_ids[:n])
        input_buffers.positions[:n].copy_(handed.positions[:n])
        return input_buffers, is_padding

    def restore_draft_prefill(self: PCPManager, *a: Any, **kw: Any) -> Any:
        saved = getattr(self, "_pcpviz_global_rows", None)
        if saved is not None:
            buffers, n, ids, pos = saved
            buffers.input_ids[:n].copy_(ids)
            buffers.positions[:n].copy_(pos)
            self._pcpviz_global_rows = None
        return restore(self, *a, **kw)

    return {(PCPManager, "get_draft_input_buffers"): get_draft_input_buffers,
            (PCPManager, "restore_draft_prefill"): restore_draft_prefill}


_pending = threading.local()  # per rank thread (the replay) or process (vLLM): a draft prefill is staged


def _eager_prefill(orig: dict) -> dict:
    prepare = orig[(PCPManager, "prepare_draft_prefill")]
    restore = orig[(PCPManager, "restore_draft_prefill")]
    dispatch = orig[(SpeculatorCudaGraphManager, "dispatch")]

    def prepare_draft_prefill(self: PCPManager, *a: Any, **kw: Any) -> Any:
        out = prepare(self, *a, **kw)
        _pending.manager = self if self.draft_prefill_batch is not None else None
        return out

    def restore_draft_prefill(self: PCPManager, *a: Any, **kw: Any) -> Any:
        _pending.manager = None
        return restore(self, *a, **kw)

    def dispatch_eager_under_pcp(self: Any, num_reqs: int, num_tokens: int, *a: Any, **kw: Any):
        manager = getattr(_pending, "manager", None)
        _pending.manager = None  # the first dispatch after prepare_draft_prefill is the draft prefill's
        if manager is not None and manager.draft_prefill_batch is not None:
            return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs,
                                            num_active_loras=kw.get("num_active_loras", a[1] if len(a) > 1 else 0))
        return dispatch(self, num_reqs, num_tokens, *a, **kw)

    return {(PCPManager, "prepare_draft_prefill"): prepare_draft_prefill,
            (PCPManager, "restore_draft_prefill"): restore_draft_prefill,
            (SpeculatorCudaGraphManager, "dispatch"): dispatch_eager_under_pcp}


def _zero_input_block_tables(orig: dict) -> dict:
    own = orig[(PCPManager, "get_dummy_block_tables")]

    def get_dummy_block_tables(self: PCPManager, num_reqs: int) -> Any:
        if self._block_tables is not None:  # noqa: SLF001 - the fix goes inside PCPManager
            self._block_tables.get_dummy_block_tables(num_reqs)  # noqa: SLF001
        return own(self, num_reqs)

    return {(PCPManager, "get_dummy_block_tables"): get_dummy_block_tables}


FIXES: dict[str, Fix] = {f.name: f for f in (
    Fix("piecewise_draft_prefill", "piecewise-draft-prefill.md",
        "copy the rank-local draft-prefill ids and positions into the speculator's captured buffers",
        ((PCPManager, "get_draft_input_buffers"), (PCPManager, "restore_draft_prefill")), _copy_local_rows),
    Fix("full_draft_prefill_state", "full-draft-prefill-state.md",
        "dispatch the draft prefill eagerly while draft_prefill_batch is set",
        ((PCPManager, "prepare_draft_prefill"), (PCPManager, "restore_draft_prefill"),
         (SpeculatorCudaGraphManager, "dispatch")), _eager_prefill),
    Fix("dspark_dummy_run_block_tables", "dspark-dummy-run-stale-block-tables.md",
        "PCPManager.get_dummy_block_tables also zeroes BlockTables.input_block_tables",
        ((PCPManager, "get_dummy_block_tables"),), _zero_input_block_tables),
)}

_lock = threading.Lock()
_active: list[str] = []


def requested(value: str | None = None) -> tuple[str, ...]:
    """The fixes ``value`` (default: ``$PCPVIZ_FIXES``) names, in FIXES order. ValueError (one line,
    naming the variable) for an unknown name."""
    raw = os.environ.get(ENV, "") if value is None else value
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if "all" in names:
        return tuple(FIXES)
    unknown = [n for n in names if n not in FIXES]
    if unknown:
        raise ValueError(f"{ENV}: unknown fix {unknown[0]!r}; known: {', '.join(FIXES)} (or all)")
    return tuple(n for n in FIXES if n in names)


def active() -> tuple[str, ...]:
    """The fixes patched in right now."""
    return tuple(_active)


def _patch(name: str) -> Callable[[], None]:
    fix = FIXES[name]
    orig = {(cls, meth): cls.__dict__[meth] if meth in cls.__dict__ else getattr(cls, meth)
            for cls, meth in fix.patches}
    had = {(cls, meth): meth in cls.__dict__ for cls, meth in fix.patches}
    for (cls, meth), fn in fix.make(orig).items():
        setattr(cls, meth, fn)
    _active.append(name)

    def undo() -> None:
        for (cls, meth), fn in orig.items():
            if had[(cls, meth)]:
                setattr(cls, meth, fn)
            else:
                delattr(cls, meth)
        _active.remove(name)
    return undo


@contextlib.contextmanager
def applied(names: tuple[str, ...] | list[str]) -> Iterator[tuple[str, ...]]:
    """Patch ``names`` (those not already active) for the ``with`` block, then put vLLM back."""
    with _lock:
        undo = [_patch(n) for n in requested(",".join(names)) if n not in _active]
    try:
        yield active()
    finally:
        with _lock:
            for u in reversed(undo):
                u()


def apply_from_env() -> tuple[str, ...]:
    """Patch what ``$PCPVIZ_FIXES`` names, for the life of the process (the plugin's call)."""
    with _lock:
        for n in requested():
            if n not in _active:
                _patch(n)
    return active()
