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
                                                         each draft forward; the fingerprints of the
                                                         hidden rows it reads and returns
                                                         (``fingerprints``)
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

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from pcpviz.vllm.recording import fingerprints
from pcpviz.vllm.recording.consumed import capturing_now, in_full_replay, note_capture
from pcpviz.vllm.recording.host import now_us

if TYPE_CHECKING:
    from pcpviz.vllm.recording.drafts import DraftContext
    from pcpviz.vllm.recording.recorder import RankRecorder

__all__ = ["install_wrappers", "uninstall_wrappers", "wrapped_targets", "install_instance_wrappers",
           "ensure_warm_up_wrapper", "recorder_of", "live_recorder", "owner_recorder", "attach_runner", "warming_up",
           "current_draft"]

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
    return live_recorder(getattr(manager, "_pcpviz_recorder", None))


def live_recorder(rec: RankRecorder | None) -> RankRecorder | None:
    """``rec`` if it records now (not switched off, not closed, not inside vLLM's warm-up unless
    dummy runs are recorded), else None."""
    if rec is None or rec.disabled or rec.closed or rec.session.mode == "off":
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


def owner_recorder(obj: Any) -> RankRecorder | None:
    """The live recorder of a model runner or speculator: its PCP manager's (PCP > 1), else its
    own (PCP = 1: ``attach_runner``)."""
    manager = getattr(obj, "pcp_manager", None)
    return recorder_of(manager) if manager is not None else recorder_of(obj)


def attach_runner(runner: Any, session: Any) -> RankRecorder | None:
    """PCP = 1 (no ``PCPManager``): give ``runner`` and its speculator a recorder of
    ``session`` (rank 0 of 1; None on a TP rank that does not record). The plugin calls it
    when a ``GPUModelRunner`` is built, the CPU replay on its stand-in runner."""
    rec = session.recorder_for_rank(0, 1)
    runner._pcpviz_recorder = rec
    spec = getattr(runner, "speculator", None)
    if spec is not None:
        spec._pcpviz_recorder = rec
    return rec


def _wrap_runner_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        ensure_warm_up_wrapper()
        if getattr(self, "pcp_manager", None) is None:
            from pcpviz.vllm.recording.sessions import active_session

            s = active_session()
            if s is not None:
                attach_runner(self, s)

    return _mark(__init__, original)


def _wrap_prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
        rec = recorder_of(self) if getattr(self, "pcp_manager", None) is None else None
        if rec is None:
            return original(self, *args, **kwargs)
        t0 = now_us()
        rec.guard(rec.begin_step)
        batch = original(self, *args, **kwargs)
        rec.guard(rec.on_global_batch, self, batch, t0)
        return batch

    return _mark(prepare_inputs, original)


def _wrap_prepare_attn(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_attn(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, input_batch, *args, **kwargs)
        rec = recorder_of(self) if getattr(self, "pcp_manager", None) is None else None
        if rec is not None:
            rec.guard(rec.on_runner_attn, self, input_batch, block_tables=out[0], slot_mappings=out[1])
        return out

    return _mark(prepare_attn, original)


def _wrap_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """``execute_model`` / ``sample_tokens``: an exception in a step makes the flight recorder
    dump its ring (then the exception goes on as before)."""
    @functools.wraps(original)
    def step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except Exception as exc:
            rec = getattr(getattr(self, "pcp_manager", None), "_pcpviz_recorder", None) or \
                getattr(self, "_pcpviz_recorder", None)
            if rec is not None and not rec.closed:
                rec.flush_quietly()
                rec.dump(f"exception: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}")
            raise

    return _mark(step, original)


def _wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def propose(self, *args: Any, **kwargs: Any) -> Any:
        rec = owner_recorder(self)
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
        rec.guard(fingerprints.on_target_hidden, ctx, bound.arguments.get("last_hidden_states"))
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
        if ctx is None or ctx.spec is not self or in_full_replay():
            return original(self, num_tokens, attn_metadata, slot_mappings, *args, **kwargs)
        mode = kwargs.get("cudagraph_runtime_mode", args[1] if len(args) > 1 else None)
        ctx.rec.guard(ctx.on_run_model, int(num_tokens), slot_mappings, getattr(mode, "name", "NONE"))
        out = original(self, num_tokens, attn_metadata, slot_mappings, *args, **kwargs)
        ctx.rec.guard(fingerprints.after_forward, ctx, out)
        return out

    return _mark(_run_model, original)


def _wrap_postprocess_sampled(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def postprocess_sampled(self, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args: Any,
                            **kwargs: Any) -> Any:
        rec = owner_recorder(self)
        t0 = now_us()
        out = original(self, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args, **kwargs)
        if rec is not None:
            states = getattr(self, "req_states", None)
            cursor = getattr(getattr(states, "num_computed_tokens", None), "gpu", None)
            rec.guard(rec.on_postprocess_sampled, idx_mapping, sampled_tokens, num_sampled, num_rejected=num_rejected,
                      t0=t0, cursor=cursor)
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
            ctx.rec.guard(ctx.on_dflash_inputs, input_buffers, query_slot_mapping,
                          context_positions=context_positions, context_slots=context_slot_mapping)
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


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        from pcpviz.vllm.recording.sessions import close_active_session

        close_active_session("finished: vLLM shut down")  # before the runner frees its buffers
        return original(self, *args, **kwargs)

    return _mark(shutdown, original)


_WORKER_WRAPPERS = {"compile_or_warm_up_model": _wrap_warm_up, "shutdown": _wrap_shutdown}


def _worker_targets() -> list[tuple[Any, str]]:
    """``(gpu_worker.Worker, name)`` for ``compile_or_warm_up_model`` and ``shutdown``; [] where
    the GPU worker module cannot be imported (the CPU replay never warms up or shuts down)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception:  # noqa: BLE001
        return []
    return [(Worker, name) for name in _WORKER_WRAPPERS if callable(getattr(Worker, name, None))]


def ensure_warm_up_wrapper() -> None:
    """Wrap ``Worker.compile_or_warm_up_model`` (``warming_up()``) and ``Worker.shutdown``
    (finalizes the process's trace files: every clean vLLM shutdown, ``LLM`` deleted, the engine
    core exiting, ``vllm serve`` on SIGINT/SIGTERM, ends there). Idempotent. Called when the
    first recording runner or PCP manager is built: inside a GPU worker, after its class exists
    and before it warms up. A no-op where the GPU worker module was never imported."""
    if "vllm.v1.worker.gpu_worker" not in sys.modules:
        return
    with _install_lock:
        for owner, name in _worker_targets():
            if not _wrapped(getattr(owner, name)):
                setattr(owner, name, _WORKER_WRAPPERS[name](getattr(owner, name)))


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

    bt.gather_block_tables = _mark(gather_block_tables, gather)
    bt.compute_slot_mappings = _mark(compute_slot_mappings, compute)
    bt._pcpviz_instance_wrapped = True


_model_classes: list[tuple[type, Any]] = []  # (class, its own __call__ before, or None): uninstall_wrappers


def install_model_wrapper(model: Any) -> None:
    """Wrap the draft model's class ``__call__`` (once per class; vLLM's ``support_torch_compile``
    sets its own ``__call__``, so module hooks would not run): inside a recorded ``propose`` the
    call's arguments become the phase's ``fwd_*`` views (``DraftContext.on_model_call``); while a
    speculator graph manager captures, they are noted for its FULL replays (``consumed``)."""
    cls = type(model)
    with _install_lock:
        if _wrapped(cls.__call__):
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

        cls.__call__ = _mark(__call__, original)
        _model_classes.append((cls, own))


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
        (GPUModelRunner, "__init__"),
        (GPUModelRunner, "prepare_inputs"),
        (GPUModelRunner, "prepare_attn"),
        (GPUModelRunner, "execute_model"),
        (GPUModelRunner, "sample_tokens"),
    ]


_WRAPPERS = {
    "propose": _wrap_propose,
    "_run_model": _wrap_run_model,
    "prepare_dflash_inputs": _wrap_prepare_dflash_inputs,
    "postprocess_sampled": _wrap_postprocess_sampled,
    "__init__": _wrap_runner_init,
    "prepare_inputs": _wrap_prepare_inputs,
    "prepare_attn": _wrap_prepare_attn,
    "execute_model": _wrap_step,
    "sample_tokens": _wrap_step,
}


def install_wrappers() -> None:
    """Patch the speculator / runner methods and the graph ledger's targets (idempotent). Inert
    unless the object has a live recorder (its PCP manager's, or its own at PCP = 1)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for owner, name in wrapped_targets():
            current = getattr(owner, name)
            if _wrapped(current):
                continue
            setattr(owner, name, _WRAPPERS[name](current))
        from pcpviz.vllm.recording.graphs import install_graph_wrappers

        install_graph_wrappers()
        _installed = True


def uninstall_wrappers() -> None:
    """Undo ``install_wrappers`` (tests)."""
    global _installed
    with _install_lock:
        targets = wrapped_targets()
        from pcpviz.vllm.recording.graphs import graph_targets

        worker = _worker_targets() if "vllm.v1.worker.gpu_worker" in sys.modules else []
        for owner, name in targets + worker + [(o, n) for o, n, _ in graph_targets()]:
            current = getattr(owner, name)
            if _wrapped(current):
                setattr(owner, name, current._pcpviz_original)
        while _model_classes:
            cls, own = _model_classes.pop()
            if own is None:
                del cls.__call__
            else:
                cls.__call__ = own
        _installed = False
