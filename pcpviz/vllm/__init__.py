"""pcpviz's bridge to the real vLLM 0.33.0 package.

- ``pcpviz.vllm.cpu_patches``: ``apply_cpu_patches()`` makes vLLM's MRv2 PCP worker
  classes (PCPManager, BlockTables, InputBatch and their Triton kernels) runnable on
  a CPU-only machine, with PCP ranks as threads sharing a ``FakePCPGroup``.
- ``pcpviz.vllm.oracle``: thin functions that call that real code and return NumPy
  results; the conformance tests compare pcpviz's re-implementation against them.

Importing this package does not import vLLM (or torch): ``apply_cpu_patches()`` must
run before vLLM is first imported, so it is the caller who decides when that happens.
"""

SUPPORTED_VLLM_VERSION = "0.33.0"
