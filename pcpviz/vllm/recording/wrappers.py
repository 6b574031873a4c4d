"""The method wrappers that feed the recorders (the state they share: ``state``; the instance and
model-class patches: ``patching``; the CUDA-graph hooks: ``graphs``).

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
from collections.abc import Callable
from typing import Any

from pcpviz.vllm.recording import fingerprints, group_calls
from pcpviz.vllm.recording.consumed import in_full_replay
from pcpviz.vllm.recording.graphs import graph_targets, install_graph_wrappers
from pcpviz.vllm.recording.host import now_us
from pcpviz.vllm.recording.patching import install_lock, is_wrapped, mark, uninstall_model_wrappers
from pcpviz.trace.flight import FlightConfig
from pcpviz.vllm.recording.sessions import active_session
from pcpviz.vllm.recording.state import (attach_runner, close_active_session, current_draft, current_session,
                                         drafting, owner_recorder, recorder_of, warm_up)

__all__ = ["install_wrappers", "uninstall_wrappers", "wrapped_targets", "ensure_warm_up_wrapper", "set_mode", "MODES"]

_installed = False



def _wrap_runner_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        ensure_warm_up_wrapper()
        group_calls.watch(eager=active_session() is not None  # a recording process: its ledger is read
                          and group_calls.runs_eagerly(getattr(self, "vllm_config", None)))
        if getattr(self, "pcp_manager", None) is None:
            s = active_session()
            if s is not None:
                attach_runner(self, s)

    return mark(__init__, original)


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

    return mark(prepare_inputs, original)


def _wrap_prepare_attn(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare_attn(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, input_batch, *args, **kwargs)
        rec = recorder_of(self) if getattr(self, "pcp_manager", None) is None else None
        if rec is not None:
            rec.guard(rec.on_runner_attn, self, input_batch, block_tables=out[0], slot_mappings=out[1])
        return out

    return mark(prepare_attn, original)


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

    return mark(step, original)


def _wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)
    read = _arguments(sig, ("input_batch", "dummy_run", "last_hidden_states"))

    @functools.wraps(original)
    def propose(self, *args: Any, **kwargs: Any) -> Any:
        rec = owner_recorder(self)
        if rec is None:
            return original(self, *args, **kwargs)
        try:
            input_batch, dummy, hidden = read(self, args, kwargs)
        except TypeError:
            return original(self, *args, **kwargs)
        dummy = bool(dummy)
        if dummy and not rec.session.record_dummy:
            return original(self, *args, **kwargs)
        ctx = rec.guard(rec.begin_propose, self, input_batch, dummy)
        if ctx is None:
            return original(self, *args, **kwargs)
        rec.guard(fingerprints.on_target_hidden, ctx, hidden)
        with drafting(ctx):
            out = original(self, *args, **kwargs)
        rec.guard(rec.end_propose, ctx, out)
        return out

    return mark(propose, original)


def _arguments(sig: inspect.Signature, names: tuple[str, ...]) -> Callable[[Any, tuple, dict], tuple]:
    """A reader of ``names`` from a call's ``(self, args, kwargs)``, as ``sig.bind`` would find them
    (defaults where not passed) without binding every call (``bind`` costs ~8 us a step); a call
    that ``bind`` would refuse raises ``TypeError`` as it does."""
    params = list(sig.parameters.values())
    plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
    where = {p.name: (i, p.kind, p.default) for i, p in enumerate(params)}
    npos = sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)
    required = [(p.name, i) for i, p in enumerate(params) if i > 0 and p.default is inspect.Parameter.empty]

    def fits(args: tuple, kwargs: dict) -> bool:  # what ``bind`` checks: no unknown, duplicate or missing argument
        n = len(args)
        return (n + 1 <= npos and all(k in where and where[k][0] > n for k in kwargs)
                and all(i <= n or k in kwargs for k, i in required))

    def read(self: Any, args: tuple, kwargs: dict) -> tuple:
        if not plain or not fits(args, kwargs):
            bound = sig.bind(self, *args, **kwargs)  # the general case, and the errors, as before
            return tuple(bound.arguments.get(n, where[n][2] if n in where else None) for n in names)
        out = []
        for n in names:
            i, kind, default = where.get(n, (None, None, None))
            if i is None:
                out.append(None)
            elif kind == inspect.Parameter.POSITIONAL_OR_KEYWORD and 0 < i <= len(args):
                out.append(args[i - 1])
            elif n in kwargs:
                out.append(kwargs[n])
            elif default is inspect.Parameter.empty:
                raise TypeError(f"missing a required argument: {n!r}")
            else:
                out.append(default)
        return tuple(out)

    return read


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

    return mark(_run_model, original)


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

    return mark(postprocess_sampled, original)


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

    return mark(prepare_dflash_inputs, original)


def _wrap_warm_up(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        with warm_up():
            return original(self, *args, **kwargs)

    return mark(compile_or_warm_up_model, original)


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        close_active_session("finished: vLLM shut down")  # before the runner frees its buffers
        return original(self, *args, **kwargs)

    return mark(shutdown, original)


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
    with install_lock:
        for owner, name in _worker_targets():
            if not is_wrapped(getattr(owner, name)):
                setattr(owner, name, _WORKER_WRAPPERS[name](getattr(owner, name)))


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
    with install_lock:
        if _installed:
            return
        for owner, name in wrapped_targets():
            current = getattr(owner, name)
            if is_wrapped(current):
                continue
            setattr(owner, name, _WRAPPERS[name](current))
        install_graph_wrappers()
        group_calls.install_group_wrappers()
        _installed = True


def uninstall_wrappers() -> None:
    """Undo ``install_wrappers`` (tests)."""
    global _installed
    with install_lock:
        targets = wrapped_targets()
        worker = _worker_targets() if "vllm.v1.worker.gpu_worker" in sys.modules else []
        for owner, name in targets + worker + [(o, n) for o, n, _ in graph_targets()]:
            current = getattr(owner, name)
            if is_wrapped(current):
                setattr(owner, name, current._pcpviz_original)
        uninstall_model_wrappers()
        group_calls.uninstall_group_wrappers()
        group_calls.watch(eager=False)
        _installed = False


MODES = ("record", "flight", "off")


def set_mode(mode: str, *, flight: FlightConfig | None = None) -> None:
    """Switch this process's recording between ``record`` (every step to the rank files),
    ``flight`` (the last steps in host memory, ``flight`` or the session's config) and ``off``
    (the wrappers removed: vLLM runs as without the plugin) between two ``generate`` calls; what
    is pending is written first. For the interleaved on/off repeats of
    ``benchmarks/bench_plugin_overhead.py``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    s = current_session()
    if s is None:
        raise ValueError("no recording session in this process (is PCPVIZ_TRACE_DIR set?)")
    for rec in list(s.recorders.values()):
        rec.flush_quietly()
        rec.sink.drain()
    if mode == "flight":
        s.flight = flight or s.flight
        if s.flight is None:
            raise ValueError("flight mode needs a FlightConfig (or PCPVIZ_FLIGHT_RECORDER)")
    if mode == "off":
        uninstall_wrappers()
    else:
        install_wrappers()
        ensure_warm_up_wrapper()
    s.mode = mode
