"""Session set-up shared by every test module.

The conformance tier drives the real vLLM 0.33.0 on CPU, which needs
TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES="" *before* triton or vLLM is first
imported (see pcpviz/vllm/cpu_patches.py). Applying the patches once, here, makes
the outcome independent of test order.
"""

from pcpviz.vllm import cpu_patches

cpu_patches.apply_cpu_patches()


def pytest_collection_modifyitems(config, items):
    """Deselect the GPU tier (marker ``gpu``): this session hides GPUs (CUDA_VISIBLE_DEVICES="")
    and CI has none. It runs on the GPU machine with ``pytest --noconftest -m gpu``."""
    keep = [i for i in items if i.get_closest_marker("gpu") is None]
    dropped = [i for i in items if i.get_closest_marker("gpu") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
