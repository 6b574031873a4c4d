"""This directory drives the real vLLM 0.33.0 on CPU: the patches are applied when it is collected
(tests/helpers/vllm_cpu_patches.py says why)."""

from vllm_cpu_patches import pytest_configure  # noqa: F401 - the hook pytest calls
