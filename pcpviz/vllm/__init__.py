"""pcpviz's bridge to the real vLLM 0.33.0 package.

- ``pcpviz.vllm.cpu_patches``: ``apply_cpu_patches()`` makes vLLM's MRv2 PCP worker
  classes (PCPManager, BlockTables, InputBatch and their Triton kernels) runnable on
  a CPU-only machine, with PCP ranks as threads sharing a ``FakePCPGroup``.
- ``pcpviz.vllm.oracle``: thin functions that call that real code and return NumPy
  results; the conformance tests compare pcpviz's re-implementation against them.
- ``pcpviz.vllm.replay(pcp=2, mtp=2, trace_dir=..., scenario="mixed")``: a multi-step
  PCP + MTP (or DSpark) scenario through vLLM's own classes on CPU, recorded as a trace
  (the ``replay`` package is itself callable; scenarios, stand-ins, ranks, scheduler, step
  and driver are its modules).
- ``pcpviz.vllm.recording``: the recording ``PCPManager`` subclass and speculator wrappers,
  shared by the replay and the plugin (sessions, recorder, drafts, manager, wrappers, host,
  meta are its modules).
- ``pcpviz.vllm.plugin``: the ``vllm.general_plugins`` entry point (inert unless
  ``PCPVIZ_TRACE_DIR`` is set).
- ``pcpviz.vllm.run(model, prompts, pcp=2, ...)``: real vLLM on GPUs with the plugin
  recording (``pcpviz.vllm.launch``).

Importing this package does not import vLLM (or torch): ``apply_cpu_patches()`` must
run before vLLM is first imported, so it is the caller who decides when that happens
(``replay`` and ``oracle`` apply the patches when imported; the process environment is left
as it was).
"""

from pcpviz.vllm.contract import SUPPORTED_VLLM_VERSION  # noqa: F401 - the one definition, re-exported


def __getattr__(name):
    # Lazy, so `import pcpviz.vllm` (and the plugin entry point) stays cheap.
    if name == "replay":
        import importlib

        return importlib.import_module("pcpviz.vllm.replay")
    if name in ("run", "build_vllm_launch", "LaunchError", "gpus_missing"):
        from pcpviz.vllm import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'pcpviz.vllm' has no attribute {name!r}")
