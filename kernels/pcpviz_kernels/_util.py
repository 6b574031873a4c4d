"""Small helpers shared by the kernels: sizes, device facts, launch with a fallback."""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRET", "next_pow2", "num_sms", "launch_with_fallback", "as_index"]

# Decided once, when the package is imported: ``triton.jit`` makes an interpreted
# function iff TRITON_INTERPRET=1 at decoration time, so this records what the
# kernels of this import are.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small stand-in under the interpreter)."""
    if device.type == "cuda" and not INTERPRET:
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def as_index(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int32/int64 tensor on ``device`` (other integer dtypes become int64)."""
    t = torch.as_tensor(t, device=device)
    if t.dtype not in (torch.int32, torch.int64):
        t = t.to(torch.int64)
    return t.contiguous()


def launch_with_fallback(launch, configs):
    """Run ``launch(**config)`` with the first config the GPU can hold.

    A config that needs more shared memory or registers than the device has
    raises ``OutOfResources`` at launch (compile) time; the next one is tried.
    Returns the config that ran.
    """
    from triton.runtime.errors import OutOfResources

    last = None
    for cfg in configs:
        try:
            launch(**cfg)
            return cfg
        except OutOfResources as e:  # pragma: no cover - GPU only
            last = e
    raise last if last is not None else RuntimeError("no kernel config given")
