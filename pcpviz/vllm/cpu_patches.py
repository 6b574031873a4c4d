"""Make the real vLLM 0.33.0 PCP classes callable on a CPU-only machine.

vLLM's MRv2 GPU worker (``PCPManager``, ``BlockTables``, ``InputBatch`` and their
Triton kernels) is plain PyTorch + Triton. On a machine without an accelerator a
few things stand in the way; ``apply_cpu_patches()`` removes exactly those and
nothing else, so the code that runs afterwards is vLLM's own.

1. environment: ``TRITON_INTERPRET=1``, ``CUDA_VISIBLE_DEVICES=""`` -- only inside
   ``cpu_environment()`` (while vLLM's modules are imported and the patches applied; the
   replay and the oracle import their vLLM modules inside it), then restored, so the rest
   of the process (a notebook kernel that later launches vLLM on GPUs, the GPU test tier)
   keeps its GPUs and compiles its own Triton kernels;
2. ``PIN_MEMORY = False`` (a CPU-only torch cannot pin);
3. ``UvaBuffer`` -> vLLM's own CPU stand-in (the "device view" is the host tensor);
4. a lock around Triton interpreter launches (ranks are threads);
5. int1 masks the Triton 3.9.0 interpreter materialises as int8 -> bool;
6. ``get_pcp_group()`` -> the calling thread's ``FakePCPGroup`` when it has one;
7. vLLM's forward context (``vllm.forward_context``) -> per rank thread when the
   thread is bound to a ``FakePCPGroup`` (the CPU replay runs ``set_forward_context``
   on every rank thread at once).

``docs/vllm-0.33-pcp-mtp.md#running-the-pcp-code-on-cpu`` explains each item; the
speculator plumbing belongs to whoever drives ``propose``, and einops is in
``requirements/vllm-cpu.txt``. Usage::

    from pcpviz.vllm import cpu_patches
    cpu_patches.apply_cpu_patches()          # before anything imports vllm.v1.*
    with cpu_patches.cpu_environment():      # vLLM modules imported here get interpreted kernels
        from vllm.v1.worker.gpu.pcp_manager import PCPManager

PCP ranks are simulated as threads of one process sharing a ``FakePCPGroup``
(``pcpviz.vllm.fake_group``)::

    group = FakePCPGroup(2)
    outs = run_ranks(group, lambda rank: manager[rank].restore_hidden_states(h[rank]))

Call ``apply_cpu_patches()`` before vLLM or Triton is imported: Triton decides at
``@triton.jit`` decoration time whether a kernel is interpreted, and vLLM decides
at import time whether Triton is usable at all.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from pcpviz.vllm.contract import SUPPORTED_VLLM_VERSION
from pcpviz.vllm.fake_group import current_fake_group

_apply_lock = threading.Lock()
_applied = False

# The forward context of each rank thread bound to a FakePCPGroup (the patched forward context).
_rank_contexts = threading.local()


# --- the patches ----------------------------------------------------------------------------------


CPU_ENVIRONMENT = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
"""What vLLM's worker modules must see when they are imported on CPU.

TRITON_INTERPRET=1: every @triton.jit kernel vLLM defines becomes an InterpretedFunction that
runs on CPU tensors (checked at decoration time). CUDA_VISIBLE_DEVICES="": vllm/triton_utils/
importing.py finds 0 active Triton drivers on a CPU box and would set HAS_TRITON=False (every
kernel[grid](...) then hits a TritonPlaceholder); an *empty* variable takes its lenient
"distributed environment" branch instead."""

WORKER_MODULES = (
    "vllm.v1.worker.gpu.model_runner",  # and through it the worker tree: block tables, batches, samplers
    "vllm.v1.worker.gpu.spec_decode.mtp.speculator",
    "vllm.v1.worker.gpu.spec_decode.dspark.speculator",
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",
    "vllm.v1.attention.ops.pcp",
)
"""vLLM modules ``apply_cpu_patches`` imports inside ``cpu_environment()``: every Triton kernel
the replay, the oracle and the teaching helpers call is defined in them (or below them), so a
later plain ``from vllm.v1.worker.gpu... import ...`` finds them interpreted."""

_env_lock = threading.RLock()
_env_depth = 0
_env_saved: dict[str, str | None] = {}


@contextlib.contextmanager
def cpu_environment() -> Iterator[None]:
    """``CPU_ENVIRONMENT`` set in ``os.environ`` for the duration, the previous values restored
    afterwards (re-entrant; process-wide while open, as environment variables are)."""
    global _env_depth, _env_saved
    with _env_lock:
        if _env_depth == 0:
            _env_saved = {k: os.environ.get(k) for k in CPU_ENVIRONMENT}
            os.environ.update(CPU_ENVIRONMENT)
        _env_depth += 1
    try:
        yield
    finally:
        with _env_lock:
            _env_depth -= 1
            if _env_depth == 0:
                for key, value in _env_saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value


def _check_not_imported_too_early() -> None:
    # If vllm.triton_utils was imported before the environment was set, vLLM has
    # already given up on Triton for the life of this process.
    tu = sys.modules.get("vllm.triton_utils")
    if tu is not None and not getattr(tu, "HAS_TRITON", False):
        raise RuntimeError(
            "vllm.triton_utils was imported before pcpviz.vllm.cpu_patches.apply_cpu_patches() "
            "and disabled Triton (HAS_TRITON=False). Call apply_cpu_patches() before importing vllm, "
            'or start Python with TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="".'
        )


def _check_version() -> None:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version != SUPPORTED_VLLM_VERSION:
        raise RuntimeError(
            f"pcpviz.vllm drives vLLM {SUPPORTED_VLLM_VERSION} only; the installed vllm is {version}."
        )


def _interpreted(kernel: Any) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def _check_kernels_interpreted() -> None:
    # Kernels decorated while TRITON_INTERPRET was unset are compiled JITFunctions
    # that need a GPU driver; nothing can convert them afterwards.
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.worker.gpu import block_table

    if not HAS_TRITON:
        raise RuntimeError(
            "vLLM disabled Triton (vllm.triton_utils.HAS_TRITON=False) even with "
            'TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES=""; is triton installed?'
        )
    if not _interpreted(block_table._compute_slot_mappings_kernel):
        raise RuntimeError(
            "vLLM's Triton kernels were created before TRITON_INTERPRET=1 was set "
            "(vllm.v1.worker.gpu.* imported before apply_cpu_patches()); they cannot run on CPU. "
            "Call apply_cpu_patches() first in a fresh process."
        )


def _vllm_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if m is not None and name.split(".")[0] == "vllm"]


def _rebind_everywhere(old: Any, new: Any, name: str) -> None:
    """Replace ``name`` in every imported vllm module whose binding *is* ``old``
    (``from x import name`` copies the object into each importer)."""
    for module in _vllm_modules():
        if getattr(module, name, None) is old:
            setattr(module, name, new)


def _patch_pin_memory() -> None:
    # vllm.utils.torch_utils.PIN_MEMORY is computed at import from
    # current_platform.is_pin_memory_available(), which is True on the
    # UnspecifiedPlatform a CPU box gets; async_tensor_h2d() (used by
    # PCPManager._build_batch_layout/partition_batch and StagedWriteTensor) would
    # then allocate pin_memory=True tensors, which a CPU-only torch refuses.
    # Several modules copied the flag with `from ... import PIN_MEMORY`.
    import vllm.utils.torch_utils as torch_utils

    _rebind_everywhere(True, False, "PIN_MEMORY")
    torch_utils.PIN_MEMORY = False


def _patch_uva_buffer() -> None:
    # buffer_utils.UvaBuffer pins host memory and maps it into the accelerator
    # (get_accelerator_view_from_cpu_tensor). RequestState and BlockTables use it
    # through UvaBackedTensor / StagedWriteTensor's write pools. On CPU the
    # "device view" can simply be the host tensor itself: vLLM's own CPU worker
    # ships that stand-in (vllm.v1.worker.cpu.buffer_utils.UvaBuffer, whose
    # uva() returns a slice of .cpu), so we use it rather than write one.
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.v1.worker.cpu.buffer_utils import UvaBuffer as CpuUvaBuffer

    original = buffer_utils.UvaBuffer
    if original is not CpuUvaBuffer:
        _rebind_everywhere(original, CpuUvaBuffer, "UvaBuffer")
    buffer_utils.UvaBuffer = CpuUvaBuffer


def _patch_triton_interpreter_lock() -> None:
    # The Triton interpreter swaps triton.language builtins for interpreted
    # versions for the duration of each launch (module-global state), and a
    # kernel's first launch rewrites its source with ast.parse, which CPython
    # 3.11 does not make thread-safe ("AST constructor recursion depth
    # mismatch" when two rank threads first launch the same kernel at once).
    # Ranks run as threads here: serialise both, launches and rewrites,
    # process-wide under one lock.
    from triton.runtime import interpreter

    call = interpreter.GridExecutor.__call__
    if getattr(call, "_pcpviz_locked", False):
        return
    lock = threading.RLock()
    rewrite = interpreter.InterpretedFunction.rewrite

    @functools.wraps(call)
    def locked_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            return call(self, *args, **kwargs)

    @functools.wraps(rewrite)
    def locked_rewrite(self: Any) -> Any:
        with lock:
            return rewrite(self)

    locked_call._pcpviz_locked = True  # type: ignore[attr-defined]
    interpreter.GridExecutor.__call__ = locked_call
    interpreter.InterpretedFunction.rewrite = locked_rewrite


def _patch_triton_interpreter_int1_masks() -> None:
    # Triton 3.9.0's interpreter can hand an int1 mask to load/store as an int8
    # NumPy array: a comparison keeps its lhs's (int8) tag, and splatting that
    # scalar then materialises int8 0/1 values; the C++ load/store helper then
    # raises "mask has unsupported dtype". vLLM's _compute_slot_mappings_kernel
    # hits this on its context-parallel branch (CP_SIZE > 1:
    # `is_local = ~sharded | is_local` with `sharded` loaded from a bool tensor).
    # Compiled Triton has no such issue. The values are right, only the dtype is
    # wrong, so truncate to one bit (i1 semantics) before the call.
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_masked_load, "_pcpviz_int1", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask: Any) -> Any:
        data = mask.data
        if isinstance(data, np.ndarray) and data.dtype != np.bool_ and np.issubdtype(data.dtype, np.integer):
            return interpreter.TensorHandle((data & 1).astype(np.bool_), mask.dtype)
        return mask

    @functools.wraps(load)
    def masked_load(self: Any, ptrs: Any, mask: Any, other: Any, *args: Any, **kwargs: Any) -> Any:
        return load(self, ptrs, as_bool(mask), other, *args, **kwargs)

    @functools.wraps(store)
    def masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        return store(self, ptrs, value, as_bool(mask), *args, **kwargs)

    masked_load._pcpviz_int1 = True  # type: ignore[attr-defined]
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store


def _patch_get_pcp_group() -> None:
    # PCPManager (rank at construction via maybe_build_pcp_manager, all_gather
    # in restore_hidden_states) and v1/attention/ops/pcp.py (KV-input gathers)
    # ask vllm.distributed for the PCP GroupCoordinator, which needs
    # torch.distributed. A thread bound to a FakePCPGroup gets that group;
    # any other thread gets vLLM's own answer, so the hook is inert otherwise.
    import vllm.distributed.parallel_state as parallel_state

    original = parallel_state.get_pcp_group
    if getattr(original, "_pcpviz_fake", False):
        return

    @functools.wraps(original)
    def get_pcp_group() -> Any:
        group = current_fake_group()
        return group if group is not None else original()

    get_pcp_group._pcpviz_fake = True  # type: ignore[attr-defined]
    # Import the two modules that bind get_pcp_group at import, so their bindings exist.
    import vllm.v1.attention.ops.pcp  # noqa: F401
    import vllm.v1.worker.gpu.pcp_manager  # noqa: F401

    _rebind_everywhere(original, get_pcp_group, "get_pcp_group")
    parallel_state.get_pcp_group = get_pcp_group


def _patch_forward_context_per_rank_thread() -> None:
    # vLLM keeps the current ForwardContext in one module global
    # (vllm.forward_context._forward_context), set by set_forward_context() around
    # every forward and read by the attention layers (get_forward_context()).
    # The CPU replay (pcpviz.vllm.replay) runs the real set_forward_context() on
    # every PCP rank thread at the same time; with one global, rank 1 would read
    # rank 0's attention metadata and slot mapping. Unavoidable as long as ranks
    # are threads: a thread bound to a FakePCPGroup keeps its own forward context;
    # every other thread gets vLLM's own functions, so the patch is inert outside
    # the replay. (A simpler driver could replace set_forward_context with a
    # null context instead; this keeps vLLM's set_forward_context itself real.)
    import vllm.forward_context as fc

    original_override = fc.override_forward_context
    if getattr(original_override, "_pcpviz_fake", False):
        return
    original_get, original_available = fc.get_forward_context, fc.is_forward_context_available

    @contextlib.contextmanager
    def override_forward_context(forward_context: Any) -> Iterator[None]:
        if current_fake_group() is None:
            with original_override(forward_context):
                yield
            return
        previous = getattr(_rank_contexts, "forward_context", None)
        _rank_contexts.forward_context = forward_context
        try:
            yield
        finally:
            _rank_contexts.forward_context = previous

    @functools.wraps(original_get)
    def get_forward_context() -> Any:
        if current_fake_group() is None:
            return original_get()
        context = getattr(_rank_contexts, "forward_context", None)
        assert context is not None, (
            "Forward context is not set. Please use `set_forward_context` to set the forward context."
        )
        return context

    @functools.wraps(original_available)
    def is_forward_context_available() -> bool:
        if current_fake_group() is None:
            return original_available()
        return getattr(_rank_contexts, "forward_context", None) is not None

    for fn in (override_forward_context, get_forward_context, is_forward_context_available):
        fn._pcpviz_fake = True  # type: ignore[attr-defined]
    _rebind_everywhere(original_override, override_forward_context, "override_forward_context")
    _rebind_everywhere(original_get, get_forward_context, "get_forward_context")
    _rebind_everywhere(original_available, is_forward_context_available, "is_forward_context_available")
    fc.override_forward_context = override_forward_context
    fc.get_forward_context = get_forward_context
    fc.is_forward_context_available = is_forward_context_available


def _quiet_kernel_import() -> None:
    """vLLM warns "Failed to import from vllm._C" when it is imported without its compiled
    kernels; on CPU they are never called, so that one line is dropped (at its logger, which
    vLLM's own logging set-up leaves alone), not every vLLM warning."""
    import logging

    class _DropKernelImport(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith("Failed to import from vllm._C")

    logging.getLogger("vllm.platforms.interface").addFilter(_DropKernelImport())


def apply_cpu_patches() -> None:
    """Prepare vLLM 0.33.0's PCP worker code to run on CPU (``cpu_environment()`` around it).

    Changes vLLM's own objects only (items 2-7 of the module doc; 6 and 7 act on threads bound
    to a ``FakePCPGroup`` only), and leaves the process environment as it found it: import
    further vLLM worker modules inside ``cpu_environment()``. Idempotent. Raises RuntimeError if
    the installed vLLM is not ``SUPPORTED_VLLM_VERSION`` or if vLLM/Triton were imported earlier
    in a way that cannot be repaired.
    """
    global _applied
    with _apply_lock:
        if _applied:
            return
        _check_not_imported_too_early()
        with cpu_environment():
            _quiet_kernel_import()
            _check_version()
            from vllm.platforms import current_platform

            current_platform.device_type  # noqa: B018 - resolved under the CPU environment, as before
            for name in WORKER_MODULES:
                importlib.import_module(name)
            _patch_pin_memory()
            _patch_uva_buffer()
            _patch_triton_interpreter_lock()
            _patch_triton_interpreter_int1_masks()
            _patch_get_pcp_group()
            _patch_forward_context_per_rank_thread()
            _check_kernels_interpreted()
        _applied = True


def patches_applied() -> bool:
    return _applied


__all__: Sequence[str] = [
    "SUPPORTED_VLLM_VERSION",
    "CPU_ENVIRONMENT",
    "WORKER_MODULES",
    "apply_cpu_patches",
    "cpu_environment",
    "patches_applied",
]
