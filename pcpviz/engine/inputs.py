"""A step's host arrays on the device: packed, one copy per dtype, from pinned memory.

Each call of :meth:`Uploader.upload` packs the named NumPy arrays into a pinned host buffer
(one per dtype), copies it to a persistent device buffer with one ``non_blocking`` copy and
hands back views of it. So a step issues two or three copies instead of one synchronous,
stream-draining copy per array (``torch.as_tensor(a, device="cuda")`` from pageable memory
waits for the stream).

The buffers form a ring of ``RING`` slots: a view stays valid until ``RING`` more uploads
have been made (the worker makes at most two per step and reads a view at most within the
step after it). Before a slot's pinned buffer is written again, the host waits for that
slot's previous copy (an event; in practice long done). On the CPU, ``upload`` converts
(zero-copy where the dtype matches) and nothing is pinned.

Example (PCP=2 target inputs of one rank)::

    up = Uploader(torch.device("cuda", 0))
    t = up.upload({"ids": (local.input_ids, torch.int64), "block_rows": (bt_local, torch.int32)})
    t["ids"]          # int64[P] on the device, a view of the slot's int64 buffer
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Uploader", "aligned", "INPUT_ALIGN"]

RING = 4
# Every view starts at a multiple of INPUT_ALIGN elements (>= 64 bytes): Triton specializes a kernel on
# whether each pointer is 16-byte aligned, so views at offsets that depend on the other arrays'
# lengths made a 32k-token prefill step recompile its attention kernel (~1 s, one H200).
INPUT_ALIGN = 16


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``INPUT_ALIGN``.

    >>> aligned(0), aligned(1), aligned(16), aligned(17)
    (0, 16, 16, 32)
    """
    return -(-n // INPUT_ALIGN) * INPUT_ALIGN

_NP = {torch.int64: np.int64, torch.int32: np.int32}


class _Slot:
    def __init__(self) -> None:
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.dev: dict[torch.dtype, torch.Tensor] = {}
        self.event = None


class Uploader:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._slots = [_Slot() for _ in range(RING)]
        self._next = 0
        self.num_copies = 0  # host-to-device copies issued (tests count them)

    def upload(self, arrays: dict[str, tuple[np.ndarray, torch.dtype]]) -> dict[str, torch.Tensor]:
        """``{name: (array, dtype)}`` -> ``{name: tensor}`` on the device, same shapes."""
        if not self.cuda:
            return {k: torch.as_tensor(np.ascontiguousarray(a), dtype=dt) for k, (a, dt) in arrays.items()}
        slot = self._slots[self._next]
        self._next = (self._next + 1) % RING
        if slot.event is not None:
            slot.event.synchronize()  # the pinned buffer's last copy has left
        sizes: dict[torch.dtype, int] = {}
        for a, dt in arrays.values():
            sizes[dt] = sizes.get(dt, 0) + aligned(int(np.size(a)))
        for dt, n in sizes.items():
            if dt not in slot.host or slot.host[dt].numel() < n:
                cap = max(256, 1 << max(n - 1, 1).bit_length())
                slot.host[dt] = torch.empty(cap, dtype=dt, pin_memory=True)
                slot.dev[dt] = torch.empty(cap, dtype=dt, device=self.device)
        offsets = dict.fromkeys(sizes, 0)
        out = {}
        for name, (a, dt) in arrays.items():
            a = np.asarray(a)
            n, off = a.size, offsets[dt]
            slot.host[dt].numpy()[off: off + n] = a.reshape(-1)  # casts to the buffer's dtype
            out[name] = (off, n, a.shape, dt)
            offsets[dt] = off + aligned(n)
        for dt, n in sizes.items():
            if n:
                slot.dev[dt][:n].copy_(slot.host[dt][:n], non_blocking=True)
                self.num_copies += 1
        slot.event = torch.cuda.Event()
        slot.event.record()
        return {name: slot.dev[dt][off: off + n].view(shape) for name, (off, n, shape, dt) in out.items()}
