"""Shared by the conftests of the directories that drive the real vLLM 0.33.0 on CPU: vLLM's worker
modules must be first imported under ``pcpviz.vllm.cpu_patches`` (Triton kernels interpreted).
Applying the patches when such a directory is collected, before any of its modules is imported,
makes the outcome independent of test order; they change vLLM's own objects only and leave the
process environment as it was (``cpu_environment()`` is scoped). A GPU session (``-m gpu``)
skips them.
"""


def pytest_configure(config):
    if "gpu" not in (config.getoption("markexpr", "") or ""):
        from pcpviz.vllm import cpu_patches

        cpu_patches.apply_cpu_patches()
