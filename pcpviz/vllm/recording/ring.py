"""The device ring: where a recorder's copies of vLLM's tensors land on the device, preallocated.

Every hook writes its views of one dtype with one ``torch.cat(..., out=)`` into the ring (no
allocation on the step's thread); a step is one contiguous span of it. At the step's end the
step thread records one event (CUDA) and hands the span on; the drain (the sink's thread, or
inline on CPU) waits for the event, copies the span to a pinned host buffer on a side stream and
gives the span back. Nothing on the step's thread waits for the device.

When the undrained steps fill the ring (the writer is behind, or one step is larger than the
ring) the step being recorded is **dropped**: its views are not written, ``overflow_steps``
counts it, the recorder warns once and the trace says so (run.json ``device_ring_overflow``,
and the rank ends ``partial``: ``pcpviz check`` reports the trace INCOMPLETE with the reason).

Spans, 1 MiB ring, three decode steps of 100 kB undrained and a fourth being recorded::

    [ step 7 | step 8 | step 9 | step 10 ... free ... ]      head after step 10's last put
      ^ oldest undrained span (released by the drain, in order)

A put that would run past the end moves the step's bytes so far to offset 0 (one device copy,
once per lap) if that region is free.

``PCPVIZ_DEVICE_RING_MB`` sets the ring's size (default 64 MiB per recorder).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any

import torch

__all__ = ["DeviceRing", "ENV_RING_MB", "DEFAULT_RING_MB", "ring_bytes", "ALIGN"]

logger = logging.getLogger("vllm.pcpviz")

ENV_RING_MB = "PCPVIZ_DEVICE_RING_MB"
DEFAULT_RING_MB = 64.0
ALIGN = 8  # every view's offset is a multiple of 8 bytes (int64 / float64 views stay aligned)


def ring_bytes() -> int:
    """``PCPVIZ_DEVICE_RING_MB`` in bytes (a bad value: one warning and the default)."""
    raw = os.environ.get(ENV_RING_MB, "").strip()
    try:
        mb = float(raw) if raw else DEFAULT_RING_MB
        if not mb > 0 or mb == float("inf"):
            raise ValueError(raw)
    except ValueError:
        logger.warning("pcpviz: %s=%r is not a positive number of MB; using %g", ENV_RING_MB, raw, DEFAULT_RING_MB)
        mb = DEFAULT_RING_MB
    return max(int(mb * (1 << 20)) // ALIGN * ALIGN, ALIGN)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class DeviceRing:
    """A byte ring on one device: the step being recorded grows at ``head`` from ``start``;
    ``spans`` are the steps handed on and not yet drained (oldest first)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = ring_bytes() if capacity is None else max(_align(capacity), ALIGN)
        self.buf: torch.Tensor | None = None  # uint8[capacity], allocated on the first put's device
        self.start = self.head = 0  # the step being recorded: bytes [start, head)
        self.spans: deque[tuple[int, int]] = deque()  # in the order they were handed on
        self.top = 0  # the largest end of the undrained spans (0: none)
        self.dropped = False  # the step being recorded no longer fits: its views are dropped
        self.overflow_steps = 0
        self._lock = threading.Lock()

    def ensure(self, device: torch.device) -> None:
        if self.buf is None:
            with torch.inference_mode(False):
                self.buf = torch.empty(self.capacity, dtype=torch.uint8, device=device)

    def _free(self, a: int, b: int) -> bool:
        if b > self.capacity:
            return False
        if a >= self.top:  # past every undrained span (the usual case until the ring wraps)
            return True
        for s, e in self.spans:
            if b > s and a < e:
                return False
        return True

    def reserve(self, nbytes: int) -> int | None:
        """Room for ``nbytes`` more of the step being recorded: the offset of its first byte in
        the ring (aligned), or None when the ring is full (the step is then dropped)."""
        if self.dropped:
            return None
        with self._lock:
            at = (self.head + ALIGN - 1) // ALIGN * ALIGN
            end = at + nbytes
            if self._free(self.start, end):
                self.head = end
                return at
            used = at - self.start  # this step's bytes so far: moved to the ring's start if there is room
            if self.start > 0 and self._free(0, used + nbytes) and used + nbytes <= self.start:
                if used:
                    assert self.buf is not None
                    self.buf[:used].copy_(self.buf[self.start:self.start + used])
                self.start, self.head = 0, used + nbytes
                return used
        self.dropped = True
        self.head = self.start
        return None

    def view(self, at: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The ring's bytes from ``at`` as ``dtype[numel]``."""
        assert self.buf is not None
        return self.buf[at:at + numel * dtype.itemsize].view(dtype)

    def offset(self, at: int) -> int:
        """An offset in the ring as an offset in the step being recorded."""
        return at - self.start

    def finish(self) -> tuple[int, int] | None:
        """End the step being recorded: its span (None if it is empty or was dropped, counted)."""
        span = (self.start, self.head) if self.head > self.start and not self.dropped else None
        if self.dropped:
            self.overflow_steps += 1
        with self._lock:
            if span is not None:
                self.spans.append(span)
                self.top = max(self.top, span[1])
            self.start = self.head = _align(self.head) if span is not None else self.start
        self.dropped = False
        return span

    def discard(self) -> None:
        """Forget the step being recorded."""
        self.head = self.start
        self.dropped = False

    def release(self, span: tuple[int, int]) -> None:
        """The drain copied ``span`` out: its bytes may be written again."""
        with self._lock:
            spans = self.spans
            removed = True
            if spans and spans[0] == span:  # the drain releases in order: the usual case is O(1)
                spans.popleft()
            else:
                try:
                    spans.remove(span)
                except ValueError:
                    removed = False
            if not spans:
                self.top = 0
            elif removed and span[1] >= self.top:  # the span that ended highest went: find the new top
                self.top = max(e for _, e in spans)
            if not self.spans and self.head == self.start:
                self.start = self.head = 0  # nothing in flight: start the next step at the ring's start

    def bytes_of(self, span: tuple[int, int]) -> torch.Tensor:
        assert self.buf is not None
        return self.buf[span[0]:span[1]]

    def stats(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "undrained_steps": len(self.spans), "overflow_steps": self.overflow_steps}
