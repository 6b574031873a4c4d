"""The method wrappers that feed the recorders, and the state they share with the PCP manager.

What is wrapped (``wrapped_targets``; ``install_wrappers`` patches the classes once, idempotent;
every wrapper is inert unless the object's PCP manager is a ``RecordingPCPManager`` with a live
recorder):

=======================================================  ============================================
vLLM 0.33.0 method                                       records
=======================================================  ============================================
``TargetDependentARSpeculator.propose`` (MTP),           opens a ``DraftContext`` for the call (the
``DFlashSpeculator.propose`` (DSpark)                    thread-local ``current_draft()``); at the end
                                                         ``draft_tokens`` and the step is written
``TargetDependentARSpeculator._run_model``               ``DraftContext.on_forward``: the inputs of
                                                         each draft forward
``GPUModelRunner.postprocess_sampled``                   the ``verify`` phase
``dflash.speculator.prepare_dflash_inputs`` (module)     DSpark's replicated drafter inputs
``Worker.compile_or_warm_up_model``                      ``warming_up()`` while vLLM warms up
``BlockTables.gather_block_tables`` /                    on the speculator's own instance
``compute_slot_mappings``                                (``install_instance_wrappers``): counts and
                                                         the unexpanded draft slot mapping
=======================================================  ============================================

Each wrapper keeps the original in ``_pcpviz_original`` (``uninstall_wrappers`` restores it).
For a PCP=2, K=2 MTP step on rank 1, the calls the wrappers see, in order: ``postprocess_sampled``
(verify) -> ``propose`` -> ``_run_model`` (draft_0, rank-local) -> ``gather_block_tables`` (the
global rows, counted) -> ``compute_slot_mappings`` -> ``_run_model`` (draft_1, replicated) -> the
end of ``propose`` (draft tokens; the step is written).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pcpviz.vllm.recording.host import now_us

if TYPE_CHECKING:
    from pcpviz.vllm.recording.drafts import DraftContext
    from pcpviz.vllm.recording.recorder import RankRecorder

__all__ = ["install_wrappers", "uninstall_wrappers", "wrapped_targets", "install_instance_wrappers",
           "ensure_warm_up_wrapper", "recorder_of", "warming_up", "current_draft"]

_tls = threading.local()  # .ctx: the DraftContext of the propose running on this thread
_warmup_depth = 0  # > 0 inside vLLM's Worker.compile_or_warm_up_model (this process)


def current_draft() -> DraftContext | None:
    """The ``DraftContext`` of the ``propose`` running on this thread (None outside one)."""
    return getattr(_tls, "ctx", None)


def warming_up() -> bool:
    """True while vLLM warms up before serving: ``Worker.compile_or_warm_up_model`` runs
    synthetic scheduler steps (requests ``_warmup_{i}_``, ``_v2_mixed_warmup_*``; fake draft
    tokens) through ``execute_model`` when it compiles (``cudagraph_mode`` PIECEWISE, JIT warm-up)."""
    return _warmup_depth > 0


def recorder_of(manager: Any) -> RankRecorder | None:
    """The live recorder of a ``RecordingPCPManager`` (None for anything else, and during
    vLLM's warm-up unless the session records dummy runs: ``PCPVIZ_RECORD_DUMMY=1``)."""
    rec = getattr(manager, "_pcpviz_recorder", None)
    if rec is None or rec.disabled or rec.closed:
        return None
    if _warmup_depth > 0 and not rec.session.record_dummy:
        return None
    return rec


_installed = False
_install_lock = threading.Lock()


def _wrapped(fn: Any) -> bool:
    return bool(getattr(fn, "_pcpviz_wrapper", False))


def _mark(fn: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    fn._pcpviz_wrapper = True  # type: ignore[attr-defined]
    fn._pcpviz_original = original  # type: ignore[attr-defined]
    return fn


def _wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def propose(self, *args: Any, **kwargs: Any) -> Any:
        rec = recorder_of(getattr(self, "pcp_manager", None))
        if rec is None:
            return original(self, *args, **kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs)
            input_batch = bound.arguments["input_batch"]
            dummy = bool(bound.arguments.get("dummy_run", False))
        except TypeError:
            return original(self, *args, **kwargs)
        if dummy and not rec.session.record_dummy:
            return original(self, *args, **kwargs)
        ctx = rec.guard(rec.begin_propose, self, input_batch, dummy)
        if ctx is None:
            return original(self, *args, **kwargs)
        previous = current_draft()
        _tls.ctx = ctx
        try:
            out = original(self, *args, **kwargs)
        finally:
            _tls.ctx = previous
        rec.guard(rec.end_propose, ctx, out)
        return out

    return _mark(propose, original)


def _wrap_run_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _run_model(self, num_tokens, attn_metadata=None, slot_mappings=None, *args: Any, **kwargs: Any) -> Any:
        ctx = current_draft()
        if ctx is not None and ctx.spec is self:
            ctx.rec.guard(ctx.on_forward, int(num_tokens), slot_mappings)
        return original(self, num_tokens, attn_metadata, slot_mappings, *args, **kwargs)

    return _mark(_run_model, original)


def _wrap_postprocess_sampled(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def postprocess_sampled(self, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args: Any,
                            **kwargs: Any) -> Any:
        rec = recorder_of(getattr(self, "pcp_manager", None))
        t0 = now_us()
        out = original(self, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args, **kwargs)
        if rec is not None:
            rec.guard(rec.on_postprocess_sampled, idx_mapping, sampled_tokens, num_sampled, num_rejected, t0)
        return out

    return _mark(postprocess_sampled, original)


def _wrap_prepare_dflash_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_dflash_inputs(input_buffers, query_slot_mapping, context_positions, context_slot_mapping,
                              *args: Any, **kwargs: Any) -> Any:
        out = original(input_buffers, query_slot_mapping, context_positions, context_slot_mapping,
                       *args, **kwargs)
        ctx = current_draft()
        if ctx is not None and not ctx.dummy:
            ctx.rec.guard(ctx.on_dflash_inputs, input_buffers, query_slot_mapping, context_positions,
                          context_slot_mapping)
        return out

    return _mark(prepare_dflash_inputs, original)


def _wrap_warm_up(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        global _warmup_depth
        _warmup_depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _warmup_depth -= 1

    return _mark(compile_or_warm_up_model, original)


def _warm_up_target() -> tuple[Any, str] | None:
    """``(gpu_worker.Worker, "compile_or_warm_up_model")``; None where the GPU worker module
    cannot be imported (the CPU replay never warms up)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception:  # noqa: BLE001
        return None
    return (Worker, "compile_or_warm_up_model") if callable(getattr(Worker, "compile_or_warm_up_model", None)) \
        else None


def ensure_warm_up_wrapper() -> None:
    """Wrap ``Worker.compile_or_warm_up_model`` (idempotent). Called when the first
    ``RecordingPCPManager`` is built: inside a GPU worker, after its class exists and before it
    warms up. A no-op where the GPU worker module was never imported (the CPU replay)."""
    if "vllm.v1.worker.gpu_worker" not in sys.modules:
        return
    with _install_lock:
        warm = _warm_up_target()
        if warm is not None and not _wrapped(getattr(*warm)):
            setattr(warm[0], warm[1], _wrap_warm_up(getattr(*warm)))


def install_instance_wrappers(spec: Any) -> None:
    """Wrap ``gather_block_tables`` / ``compute_slot_mappings`` on the speculator's own
    ``BlockTables`` instance (shared with the runner and the PCP manager): they record only
    inside a recorded ``propose`` on the calling thread."""
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
        if ctx is not None and ctx.spec.block_tables is bt:
            ctx.rec.guard(ctx.on_compute_slot_mappings, result)
        return result

    bt.gather_block_tables = _mark(gather_block_tables, gather)
    bt.compute_slot_mappings = _mark(compute_slot_mappings, compute)
    bt._pcpviz_instance_wrapped = True


def wrapped_targets() -> list[tuple[Any, str]]:
    """``(owner, attribute)`` of everything ``install_wrappers`` patches (the plugin checks that
    each exists before patching anything)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_speculator
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator

    return [
        (TargetDependentARSpeculator, "propose"),
        (TargetDependentARSpeculator, "_run_model"),
        (dflash_speculator.DFlashSpeculator, "propose"),
        (dflash_speculator, "prepare_dflash_inputs"),
        (GPUModelRunner, "postprocess_sampled"),
    ]


_WRAPPERS = {
    "propose": _wrap_propose,
    "_run_model": _wrap_run_model,
    "prepare_dflash_inputs": _wrap_prepare_dflash_inputs,
    "postprocess_sampled": _wrap_postprocess_sampled,
}


def install_wrappers() -> None:
    """Patch the speculator / runner methods (idempotent). Inert unless the object's PCP
    manager is a ``RecordingPCPManager`` with a live recorder."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for owner, name in wrapped_targets():
            current = getattr(owner, name)
            if _wrapped(current):
                continue
            setattr(owner, name, _WRAPPERS[name](current))
        _installed = True


def uninstall_wrappers() -> None:
    """Undo ``install_wrappers`` (tests)."""
    global _installed
    with _install_lock:
        targets = wrapped_targets()
        warm = _warm_up_target() if "vllm.v1.worker.gpu_worker" in sys.modules else None
        for owner, name in targets + ([warm] if warm else []):
            current = getattr(owner, name)
            if _wrapped(current):
                setattr(owner, name, current._pcpviz_original)
        _installed = False
