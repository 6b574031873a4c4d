"""A recorded step on its way to the host: ``StagedStep`` (its phases' entries, its span of the
device ring, the event after its last copy) and ``drain_steps``, which takes several of them to
the host at once; off vLLM's step thread (the sink's sender, or inline on CPU).

Three decode steps of 1.2 kB each, staged in the ring at bytes [0, 1208), [1208, 2416),
[2416, 3624): ``drain_steps`` makes one host buffer of 3,624 bytes, copies the three spans into it
on the drain's own CUDA stream behind each step's event (``wait_event``: the host waits for none of
them), waits once, gives the spans back to the ring and fills in each step's device entries and
plan places; the writer process reads step k's bytes as the next ``nbytes`` of the buffer.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import torch

from pcpviz.trace.packed import resolve
from pcpviz.vllm.recording.ring import DeviceRing

__all__ = ["StagedStep", "drain_steps", "host_pool", "take_event"]

_EVENTS: dict[int, list] = {}  # device index -> events whose step was drained (``take_event``)
MAX_POOLED_EVENTS = 256  # per device


def take_event(device: int) -> Any:
    """A CUDA event for a staged step on ``device``: one a drained step gave back, else a new one
    (making an event costs about as much again as recording it, on one H200's host:
    tools/gpu/op_costs.py). An event is recorded on one device for its life, hence a pool per device."""
    try:
        return _EVENTS.setdefault(device, []).pop()
    except IndexError:
        return torch.cuda.Event()


def _give_event(event: Any, device: int) -> None:
    """``event`` was waited for (its step's copies are done): a later step on ``device`` may record it again."""
    pool = _EVENTS.setdefault(device, [])
    if len(pool) < MAX_POOLED_EVENTS:
        pool.append(event)


class _HostPool:
    """Host buffers reused for the steps' copies (pinned where there is CUDA: PyTorch's caching
    host allocator would hand out fresh pinned blocks while earlier steps' are alive, and pinning
    memory costs far more than a copy). A buffer goes back when its step was copied out."""

    def __init__(self) -> None:
        self.free: list[tuple[torch.Tensor, bool]] = []  # (buffer, pinned): ``is_pinned`` asks the driver
        self.pinned: dict[int, bool] = {}  # id(buffer) -> pinned, for the buffers handed out
        self.lock = threading.Lock()

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self.lock:
            for i, (buf, is_pinned) in enumerate(self.free):
                if is_pinned == pinned and buf.numel() >= nbytes:
                    del self.free[i]
                    self.pinned[id(buf)] = pinned
                    return buf
        with torch.inference_mode(False):
            buf = torch.empty(max(nbytes * 2, 1 << 16), dtype=torch.uint8, pin_memory=pinned)
        with self.lock:
            self.pinned[id(buf)] = pinned
        return buf

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            pinned = self.pinned.pop(id(buf), None)
            if pinned is not None and len(self.free) < 8:
                self.free.append((buf, pinned))


_POOL = _HostPool()


def host_pool() -> _HostPool:
    return _POOL


class StagedStep:
    """A step on its way to the host: ``phases`` (``{phase: {view: entry}}``; the device
    tensors' entries are filled in by ``wait``, off the step's path, from ``layout``), its span of
    the device ring (``span``, ``nbytes``) and the event recorded after its last copy into it.
    ``wait`` (the drain, off the step's thread) waits for the event, copies the span to a host
    buffer (pinned, on a side stream, where there is CUDA) and gives the span back to the ring."""

    def __init__(self, phases: dict[str, dict[str, Any]], ring: DeviceRing | None = None,
                 span: tuple[int, int] | None = None, event: Any = None, *, layout: list | None = None,
                 replays: list | None = None) -> None:
        self.phases, self.ring, self.span, self.event, self.layout = phases, ring, span, event, layout
        self.replays = replays  # [(phase, plan entries, offset in the step)] (``replayplan``)
        self.nbytes = 0 if span is None else span[1] - span[0]
        self.host: torch.Tensor | None = None
        self.placed: list = []  # where the plan hits landed (``pcpviz.trace.packed.resolve``), set by ``wait``

    def wait(self) -> np.ndarray | None:
        """Wait for the copies (the GIL is released while waiting), move the step's bytes to the
        host and fill in the device tensors' entries; the bytes (uint8[nbytes], None if none).
        ``drain_steps`` of this step alone."""
        host = drain_steps([self])[2]
        if host is not None:
            self.host = host
        return None if self.host is None else self.host[: self.nbytes].numpy()

    def release(self) -> None:
        """The host buffer is no longer read (copied out): back to the pool; a span never
        copied out (a step dropped on its way) goes back to the ring."""
        if self.host is not None:
            _POOL.give(self.host)
        elif self.span is not None and self.ring is not None:
            if self.event is not None:
                self.event.synchronize()
                _give_event(self.event, self.ring.buf.get_device())
                self.event = None
            self.ring.release(self.span)
        self.host, self.span = None, None

    def resolve(self) -> dict[str, dict[str, Any]]:
        """The step as NumPy arrays of its own (``pcpviz.trace.packed.resolve``)."""
        buf = self.wait()
        out = resolve(self.phases, buf, self.placed)
        self.release()
        return out


def drain_steps(steps: list[StagedStep]) -> tuple[np.ndarray | None, list[int], Any]:
    """Several staged steps to the host at once (the sink's sender, off the step's thread): their
    spans copied into one host buffer, one after the other, behind their events on the drain's own
    stream (``wait_event``: nothing on the host waits per step), then one wait for the copies; the
    spans go back to the ring and each step's entries and plan places are filled in. Returns the
    bytes (uint8[sum], None if none), each step's byte count in them, and the host buffer (give it
    back with ``host_pool().give`` once the bytes are read; None if none)."""
    sizes = [st.nbytes if st.span is not None and st.host is None else 0 for st in steps]
    total = sum(sizes)
    host = None
    if total:
        dev0 = next(st for st, n in zip(steps, sizes) if n).ring.buf
        host = _POOL.take(total, dev0.is_cuda)
        side = _side_stream(dev0.device) if dev0.is_cuda else None
        off = 0
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for st, n in zip(steps, sizes):
                if not n:
                    continue
                if st.event is not None and side is not None:
                    side.wait_event(st.event)  # the device orders the copy after the step's copies
                host[off:off + n].copy_(st.ring.bytes_of(st.span), non_blocking=side is not None)
                off += n
        if side is not None:
            side.synchronize()  # one wait for the batch (the GIL released while it waits)
        for st, n in zip(steps, sizes):
            if n:
                if st.event is not None:
                    _give_event(st.event, dev0.get_device())
                st.event = None
                st.ring.release(st.span)
                st.span = None
    for st in steps:
        if st.layout is not None:
            _fill(st.layout)
            st.layout = None
        if st.replays:
            st.placed = _placed(st.phases, st.replays)
            st.replays = None
    return (None if host is None else host[:total].numpy()), sizes, host


def _placed(phases: dict[str, dict[str, Any]], replays: list) -> list[tuple[str, tuple[str, ...], int]]:
    """``[(phase, views, base)]``: the views each plan hit still holds (a view put again after the
    hit has another entry) and the hit's offset in the step (``pcpviz.trace.packed.resolve``)."""
    names = {id(views): name for name, views in phases.items()}
    out = []
    for phase, entries, base in replays:
        held = tuple(k for k, e in entries.items() if phase.get(k) is e)
        if held:
            out.append((names[id(phase)], held, base))
    return out


_SIDE: dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """The drain's own CUDA stream on ``device`` (the step's stream never waits for the drain)."""
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device=device)
    return s


def _fill(layout: list) -> None:
    """Put each device tensor's entry ``("b", offset, dtype, shape)`` in its place (unless a
    later view of the same name took it): ``layout`` is ``[(offset, places)]`` per packed copy,
    ``places`` ``[(box, key, slot, dtype, shape, nbytes)]`` in their order in it."""
    for off, places in layout:
        for box, key, slot, dtype, shape, nbytes in places:
            if box[key] is slot:
                box[key] = ("b", off, dtype, shape)
            off += nbytes
