"""How the recorder patches vLLM objects, below the recorder itself: the wrapper marks
(``mark``: the wrapper keeps its original for ``uninstall_wrappers``), the speculator's own
``BlockTables`` instance (``install_instance_wrappers``) and the draft model's class
``__call__`` (``install_model_wrapper``: what the forward consumed). The class-level hooks of
vLLM's methods are ``wrappers``; the CUDA-graph hooks ``graphs``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from pcpviz.vllm.recording.consumed import capturing_now, in_full_replay, note_capture
from pcpviz.vllm.recording.state import current_draft

__all__ = ["mark", "is_wrapped", "install_lock", "install_instance_wrappers", "install_model_wrapper",
           "uninstall_model_wrappers"]

install_lock = threading.Lock()  # one patcher at a time (wrappers.install_wrappers holds it too)


def is_wrapped(fn: Any) -> bool:
    return bool(getattr(fn, "_pcpviz_wrapper", False))


def mark(fn: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    fn._pcpviz_wrapper = True  # type: ignore[attr-defined]
    fn._pcpviz_original = original  # type: ignore[attr-defined]
    return fn


def install_instance_wrappers(spec: Any) -> None:
    """Wrap ``gather_block_tables`` / ``compute_slot_mappings`` on the speculator's own
    ``BlockTables`` instance (shared with the runner and the PCP manager): they record only
    inside a recorded ``propose`` on the calling thread."""
    model = getattr(spec, "model", None)
    if isinstance(model, torch.nn.Module):
        install_model_wrapper(model)
    bt = getattr(spec, "block_tables", None)
    if bt is None or getattr(bt, "_pcpviz_instance_wrapped", False):
        return
    gather, compute = bt.gather_block_tables, bt.compute_slot_mappings

    @functools.wraps(gather)
    def gather_block_tables(idx_mapping, num_reqs_padded, out=None, *args: Any, **kwargs: Any):
        result = gather(idx_mapping, num_reqs_padded, out, *args, **kwargs)
        ctx = current_draft()
        if ctx is not None and out is None and ctx.spec.block_tables is bt:
            ctx.on_gather_block_tables()
        return result

    @functools.wraps(compute)
    def compute_slot_mappings(*args: Any, **kwargs: Any):
        result = compute(*args, **kwargs)
        ctx = current_draft()
        if ctx is not None and ctx.spec.block_tables is bt and not in_full_replay():
            ctx.rec.guard(ctx.on_compute_slot_mappings, result)
        return result

    bt.gather_block_tables = mark(gather_block_tables, gather)
    bt.compute_slot_mappings = mark(compute_slot_mappings, compute)
    bt._pcpviz_instance_wrapped = True


_model_classes: list[tuple[type, Any]] = []  # (class, its own __call__ before, or None): uninstall_wrappers


def install_model_wrapper(model: Any) -> None:
    """Wrap the draft model's class ``__call__`` (once per class; vLLM's ``support_torch_compile``
    sets its own ``__call__``, so module hooks would not run): inside a recorded ``propose`` the
    call's arguments become the phase's ``fwd_*`` views (``DraftContext.on_model_call``); while a
    speculator graph manager captures, they are noted for its FULL replays (``consumed``)."""
    cls = type(model)
    with install_lock:
        if is_wrapped(cls.__call__):
            return
        own = cls.__dict__.get("__call__")
        original = cls.__call__

        @functools.wraps(original)
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if not in_full_replay():
                ctx = current_draft()
                if ctx is not None and getattr(ctx.spec, "model", None) is self:
                    ctx.rec.guard(ctx.on_model_call, args, kwargs)
                elif capturing_now():
                    try:
                        slots = get_forward_context().slot_mapping if is_forward_context_available() else None
                        note_capture(args, kwargs, slots)
                    except Exception:  # noqa: BLE001 - a capture note never breaks vLLM's capture
                        pass
            return original(self, *args, **kwargs)

        cls.__call__ = mark(__call__, original)
        _model_classes.append((cls, own))


def uninstall_model_wrappers() -> None:
    """Give every wrapped model class its own ``__call__`` back (``uninstall_wrappers``). The
    caller holds ``install_lock``."""
    while _model_classes:
        cls, own = _model_classes.pop()
        if own is None:
            del cls.__call__
        else:
            cls.__call__ = own
