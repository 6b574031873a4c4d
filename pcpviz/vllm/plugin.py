"""The pcpviz vLLM plugin: record a real vLLM 0.33.0 PCP + MTP deployment as a pcpviz trace.

Registered in ``pyproject.toml`` as a ``vllm.general_plugins`` entry point, so vLLM's
``load_general_plugins()`` calls ``register()`` in every process it starts (API server,
engine core, each worker). Usage::

    PCPVIZ_TRACE_DIR=runs/gpu-pcp2-mtp2 vllm serve data/models/pcpviz-tiny-dsv3 \\
        --prefill-context-parallel-size 2 \\
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' \\
        --enforce-eager

then ``pcpviz check runs/gpu-pcp2-mtp2`` or ``Workbench("runs/gpu-pcp2-mtp2")``.

Behaviour of ``register()``:

* **inert** unless the environment variable ``PCPVIZ_TRACE_DIR`` is set (non-empty): then it
  returns at once, imports nothing and patches nothing;
* **cheap and idempotent**: it checks ``vllm.__version__`` and, instead of importing vLLM's
  worker modules, arranges for the patch to run when ``vllm.v1.worker.gpu.model_runner`` is
  first imported (immediately if it already is) — processes that never build a model runner
  pay nothing; a second call does nothing;
* **never raises into vLLM**: on another vLLM version, a trace dir that is not a directory,
  or any patched attribute missing, it logs one warning (logger ``vllm.pcpviz``) and disables
  itself, leaving vLLM untouched;
* **what it patches** (all checked to exist first): ``GPUModelRunner.pcp_manager_cls`` becomes
  ``property(lambda self: RecordingPCPManager)`` — the hook vLLM provides for choosing the PCP
  manager class (``maybe_build_pcp_manager(..., cls=self.pcp_manager_cls)``) — and
  ``pcpviz.vllm.recording.install_wrappers()`` wraps ``TargetDependentARSpeculator.propose`` /
  ``_run_model``, ``DFlashSpeculator.propose``, ``dflash.speculator.prepare_dflash_inputs``,
  ``GPUModelRunner.postprocess_sampled`` and, for PCP = 1 (where vLLM builds no PCP manager),
  ``GPUModelRunner.__init__`` / ``prepare_inputs`` / ``prepare_attn``; ``gather_block_tables`` /
  ``compute_slot_mappings`` are wrapped on the speculator's own ``BlockTables`` instance at its
  first ``propose``; the graph-replay ledger wraps ``CUDAGraphWrapper.__call__`` and
  ``CudaGraphManager.run_fullgraph`` (``recording.graphs``); ``Worker.shutdown`` finalizes the
  process's rank files (end-of-stream marker, ``complete.json``) on every clean shutdown;
* **where traces go**: each PCP rank's TP-rank-0 worker writes
  ``$PCPVIZ_TRACE_DIR/rank{pcp_rank}.arrow`` (PCP = 1: ``rank0.arrow``); PCP rank 0 writes
  ``run.json`` (producer ``"vllm-plugin"``, vllm_version, pcp, dcp, num_speculative_tokens,
  block_size, model, ...). Other TP ranks hold the same batch views and record nothing.
  Dummy/profile runs are skipped unless ``PCPVIZ_RECORD_DUMMY=1``. A rank file that already
  exists is not overwritten (recording is disabled on that rank with a warning): use a fresh
  directory per run;
* **what it cannot record is one warning**: a process that builds vLLM's V1 model runner
  (``VLLM_USE_V2_MODEL_RUNNER=0``, or a feature the V2 runner lacks) records nothing and says so;
  draft forwards replayed as FULL CUDA graphs (``FULL_AND_PIECEWISE``) run no Python, so their
  phases carry only their draft tokens, and the first one is logged.

``cudagraph_mode`` ``NONE`` or ``PIECEWISE`` record every view (``docs/vllm-0.33-pcp-mtp.md#cuda-graphs``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from typing import Any

from pcpviz.vllm import SUPPORTED_VLLM_VERSION  # the one definition
from pcpviz.vllm.contract import ENV_TRACE_DIR  # the one definition

__all__ = ["register", "status", "SUPPORTED_VLLM_VERSION", "ENV_TRACE_DIR", "RUNNER_MODULE"]

RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"  # vLLM's V1 model runner: not recorded

logger = logging.getLogger("vllm.pcpviz")

_lock = threading.RLock()
_status: str = "not registered"
_finder: _RunnerImportHook | None = None


def status() -> str:
    """``"not registered"``, ``"inactive"`` (no PCPVIZ_TRACE_DIR), ``"pending"`` (waiting for
    the model runner module), ``"enabled"`` or ``"disabled: <reason>"``."""
    return _status


def _disable(reason: str) -> None:
    global _status
    _status = f"disabled: {reason}"
    logger.warning("pcpviz plugin disabled, vLLM runs unrecorded: %s", reason)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see the module docstring)."""
    global _status, _finder
    with _lock:
        if _status in ("enabled", "pending") or _status.startswith("disabled"):
            return
        try:
            trace_dir = os.environ.get(ENV_TRACE_DIR, "").strip()
            if not trace_dir:
                _status = "inactive"
                return
            import vllm

            version = getattr(vllm, "__version__", "unknown")
            if version != SUPPORTED_VLLM_VERSION:
                _disable(f"pcpviz records vLLM {SUPPORTED_VLLM_VERSION} only; this is vLLM {version}")
                return
            problem = _prepare_trace_dir(trace_dir)
            if problem:
                _disable(problem)
                return
            if V1_RUNNER_MODULE in sys.modules:
                _warn_on_v1_runner(sys.modules[V1_RUNNER_MODULE])
            else:
                sys.meta_path.insert(0, _RunnerImportHook(V1_RUNNER_MODULE, _warn_on_v1_runner))
            if RUNNER_MODULE in sys.modules:
                _install()
            else:
                _status = "pending"
                _finder = _RunnerImportHook(RUNNER_MODULE, lambda module: _install())
                sys.meta_path.insert(0, _finder)
        except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM
            _disable(f"{type(exc).__name__}: {exc}")


def _prepare_trace_dir(raw: str) -> str | None:
    """Normalise ``$PCPVIZ_TRACE_DIR`` in place (``~`` expanded, absolute, so every process of the
    deployment and its children agree) and create it; the reason it cannot hold a trace, or None.

    An existing trace there is not an error here: each rank creates its own files exclusively
    and a rank that finds its file taken records nothing (one warning), so nothing is overwritten.
    """
    path = os.path.abspath(os.path.expanduser(raw))
    os.environ[ENV_TRACE_DIR] = path
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{ENV_TRACE_DIR}={path} exists and is not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"{ENV_TRACE_DIR}={path} cannot be created: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{ENV_TRACE_DIR}={path} is not writable"
    return None


def _missing_targets() -> list[str]:
    """Every attribute the plugin patches or overrides that this vLLM lacks."""
    from vllm.v1.worker.gpu import model_runner, pcp_manager
    from vllm.v1.worker.gpu.block_table import BlockTables

    missing = []
    prop = model_runner.GPUModelRunner.__dict__.get("pcp_manager_cls")
    if not isinstance(prop, property):
        missing.append("GPUModelRunner.pcp_manager_cls (a property)")
    if getattr(pcp_manager, "maybe_build_pcp_manager", None) is None:
        missing.append("pcp_manager.maybe_build_pcp_manager")
    for name in ("partition_batch", "prepare_attn", "prepare_slot_mappings", "restore_for_sampling",
                 "restore_hidden_states", "prepare_draft_prefill", "restore_draft_prefill",
                 "get_draft_input_buffers", "_build_batch_layout", "validate_config"):
        if not callable(getattr(pcp_manager.PCPManager, name, None)):
            missing.append(f"PCPManager.{name}")
    for name in ("gather_block_tables", "compute_slot_mappings"):
        if not callable(getattr(BlockTables, name, None)):
            missing.append(f"BlockTables.{name}")
    from pcpviz.vllm import recording

    for owner, name in recording.wrapped_targets():
        if not callable(getattr(owner, name, None)):
            missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
    return missing


def _install() -> None:
    """Check every target, then patch (all or nothing)."""
    global _status
    with _lock:
        if _status == "enabled":
            return
        try:
            missing = _missing_targets()
            if missing:
                _disable("this vLLM lacks " + ", ".join(missing))
                return
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner

            from pcpviz.vllm import fixes, recording

            recording.install_wrappers()
            GPUModelRunner.pcp_manager_cls = property(lambda self: recording.RecordingPCPManager)
            _status = "enabled"
            logger.info("pcpviz plugin enabled: recording PCP steps into %s", os.environ.get(ENV_TRACE_DIR))
            if fixes.apply_from_env():  # opt-in fixes for docs/findings ($PCPVIZ_FIXES)
                logger.info("pcpviz plugin: vLLM patched with %s", ", ".join(fixes.active()))
        except Exception as exc:  # noqa: BLE001
            _disable(f"{type(exc).__name__}: {exc}")


def _warn_on_v1_runner(module: Any) -> None:
    """Wrap the V1 ``GPUModelRunner.__init__``: building one means this process records nothing,
    which is said once (instead of leaving an empty trace directory)."""
    cls = getattr(module, "GPUModelRunner", None)
    init = getattr(cls, "__init__", None)
    if cls is None or getattr(init, "_pcpviz_v1_warning", False):
        return

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        global _v1_warned
        if not _v1_warned:
            _v1_warned = True
            logger.warning("pcpviz: this vLLM worker runs the V1 model runner, which pcpviz does not record: "
                           "nothing is written to %s (set VLLM_USE_V2_MODEL_RUNNER=1; PCP needs it anyway)",
                           os.environ.get(ENV_TRACE_DIR))

    __init__._pcpviz_v1_warning = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


_v1_warned = False


class _RunnerImportHook(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after the module ``name`` is executed (one shot)."""

    def __init__(self, name: str = RUNNER_MODULE, then: Any = None) -> None:
        self.name = name
        self.then = then if then is not None else (lambda module: _install())

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; also avoids finding ourselves below
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            if self.name == RUNNER_MODULE:
                _disable(f"cannot hook the import of {RUNNER_MODULE}")
            return spec
        loader, then = spec.loader, self.then
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            try:
                then(module)
            except Exception as exc:  # noqa: BLE001 - a plugin must never break vLLM
                logger.warning("pcpviz: %s: %s: %s", fullname, type(exc).__name__, exc)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
