"""Copies of vLLM's tensors taken when a hook fires, moved to the host once per step.

A hook copies what it records on its device (``copy_views``: one packed copy per dtype):
vLLM's persistent buffers are overwritten by the next step (and CUDA graphs replay them by
address, so they are never re-allocated). At the end of the step ``stage`` starts the copies
to pinned host memory and records one event, without waiting; the step is resolved to NumPy
(``StagedStep.resolve``) later, off the step's path, and ``trim_block_tables`` cuts the
block-table views to the columns in use.

Block-table rows as a forward pass sees them (``block_rows``), PCP=2, block size 4, a
request with 6 tokens (2 blocks) in a persistent row that held a 3-block request before::

    row in the gathered table   [7, 9, 4, 0, ...]     (4: left over from the previous occupant)
    num_blocks of the request   2
    recorded row                [7, 9, 0, 0, ...]     stale = 1
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

__all__ = ["copy_now", "copy_views", "Packed", "StagedStep", "stage", "to_host", "host_all", "now_us",
           "block_rows", "trim_block_tables"]


def copy_now(value: Any) -> Any:
    """A copy taken now: tensors are cloned on their device (moved at step end)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


class Packed:
    """A view copied into one flat device buffer with the other views of its hook call that
    share its dtype (one kernel for all of them instead of one clone each)."""

    __slots__ = ("buf", "start", "shape")

    def __init__(self, buf: torch.Tensor, start: int, shape: tuple[int, ...]) -> None:
        self.buf, self.start, self.shape = buf, start, shape


def copy_views(views: dict[str, Any]) -> dict[str, Any]:
    """The copies of one hook call's views: device tensors packed per dtype (``Packed``; a lone
    one is cloned), host values copied. A PCP=2 target hook with 14 int64/int32 device views
    launches 2 copy kernels, not 14."""
    out: dict[str, Any] = {}
    groups: dict[tuple[Any, Any], list[tuple[str, torch.Tensor]]] = {}
    for name, value in views.items():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            groups.setdefault((value.dtype, value.device), []).append((name, value.detach()))
        else:
            out[name] = copy_now(value)
    for items in groups.values():
        if len(items) == 1:
            out[items[0][0]] = items[0][1].clone()
            continue
        flat = torch.cat([t.reshape(-1) for _, t in items])
        start = 0
        for name, t in items:
            out[name] = Packed(flat, start, tuple(t.shape))
            start += t.numel()
    return out


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()


class _PinnedPool:
    """Pinned host buffers reused for the steps' copies (PyTorch's caching host allocator would
    hand out fresh pinned blocks while earlier steps' arrays are alive, and pinning memory costs
    far more than a copy). A buffer goes back to the pool when its step is resolved (copied out)."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            for i, buf in enumerate(self.free):
                if buf.numel() >= nbytes:
                    return self.free.pop(i)
        return torch.empty(max(nbytes * 2, 1 << 16), dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self.lock:
            if len(self.free) < 8:
                self.free.append(buf)


_POOL: _PinnedPool | None = None


class StagedStep:
    """A step's views on their way to the host: device buffers copied into one pinned buffer
    without waiting, one CUDA event after them; ``resolve()`` waits for it (by then, usually long
    done) and returns the step as NumPy arrays of its own (the pinned buffer is reused)."""

    def __init__(self, phases: dict[str, dict[str, Any]], host: dict[int, torch.Tensor],
                 event: Any, buf: torch.Tensor | None = None) -> None:
        self.phases, self.host, self.event, self.buf = phases, host, event, buf

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def resolve(self) -> dict[str, dict[str, Any]]:
        if self.event is not None:
            self.event.synchronize()
        out: dict[str, dict[str, Any]] = {}
        for name, views in self.phases.items():
            res = out[name] = {}
            for v, x in views.items():
                if isinstance(x, Packed):
                    flat = self.host.get(id(x.buf), x.buf)
                    n = int(np.prod(x.shape, dtype=np.int64))
                    res[v] = _numpy(flat[x.start:x.start + n].reshape(x.shape)).copy()
                elif isinstance(x, torch.Tensor):
                    res[v] = _numpy(self.host[id(x)]).copy() if id(x) in self.host else _numpy(x)
                else:
                    res[v] = to_host(x)
        self.host = {}
        if self.buf is not None and _POOL is not None:
            _POOL.give(self.buf)  # every view was copied out of it
            self.buf = None
        return out


def stage(phases: dict[str, dict[str, Any]]) -> StagedStep:
    """Start moving a step's device copies to the host (one pinned buffer of a small pool,
    ``non_blocking``, on the current stream, where the hooks took them) and record one event;
    no synchronisation."""
    global _POOL
    tensors: dict[int, torch.Tensor] = {}
    for views in phases.values():
        for x in views.values():
            t = x.buf if isinstance(x, Packed) else x
            if isinstance(t, torch.Tensor) and t.is_cuda:
                tensors.setdefault(id(t), t)
    if not tensors:
        return StagedStep(phases, {}, None)
    sizes = {k: -(-t.numel() * t.element_size() // 8) * 8 for k, t in tensors.items()}
    if _POOL is None:
        _POOL = _PinnedPool()
    buf = _POOL.take(sum(sizes.values()))
    host: dict[int, torch.Tensor] = {}
    off = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        dst = buf[off:off + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
        dst.copy_(t, non_blocking=True)
        host[k] = dst
        off += sizes[k]
    event = torch.cuda.Event()
    event.record()
    return StagedStep(phases, host, event, buf)


def to_host(value: Any) -> Any:
    """A tensor (or a list of tensors, stacked) as a NumPy array; bfloat16 as float32."""
    if isinstance(value, torch.Tensor):
        return _numpy(value.cpu())
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return np.stack([to_host(v) for v in value])
    return value


def host_all(phases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every view of a step on the host at once (``stage`` then ``resolve``)."""
    return stage(phases).resolve()


def now_us() -> int:
    """Wall-clock microseconds (the ``t_start_us`` / ``t_end_us`` views)."""
    return time.time_ns() // 1000


def block_rows(block_tables: Any, tables: Any, idx_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """G forward-pass block tables (rows in batch order) -> ``([G, rows, W], stale)``, a copy.

    vLLM's ``_gather_block_tables_kernel`` copies a request's first ``num_blocks`` entries
    into a persistent row and leaves the rest of the row as the previous occupant left it;
    attention never reads past ``num_blocks`` (seq_lens bound it). The copy keeps the
    allocated entries and zeroes the tail, so rows compare with the request's global row;
    ``stale`` counts the non-zero tail entries that were dropped (int64 scalar)."""
    rows = torch.stack([t.detach() for t in tables]).clone()  # [G, rows, W]
    n = min(rows.shape[1], idx_mapping.shape[0])
    nb = torch.zeros(rows.shape[0], rows.shape[1], dtype=torch.int64, device=rows.device)
    if n:
        nb[:, :n] = block_tables.num_blocks.gpu[:, idx_mapping[:n].clamp(min=0)].to(torch.int64)
    tail = torch.arange(rows.shape[2], device=rows.device).view(1, 1, -1) >= nb.unsqueeze(-1)
    stale = (rows.ne(0) & tail).sum()
    rows.masked_fill_(tail, 0)
    return rows, stale


_BT_PREFIX = "block_table"  # block_table_global / _local / _draft (and the replay's *_no_gather)


def trim_block_tables(phases: dict[str, dict[str, Any]]) -> None:
    """Cut every block-table view of a step to the columns any of them uses (the rest are
    zeros in all of them): vLLM's rows are ``max_model_len / block_size`` wide."""
    tables = [(ph, v) for ph, views in phases.items() for v, a in views.items()
              if v.startswith(_BT_PREFIX) and isinstance(a, np.ndarray) and a.ndim >= 2 and a.dtype.kind in "iu"]
    if not tables:
        return
    width = 1
    for ph, v in tables:
        a = phases[ph][v]
        cols = np.flatnonzero(a.reshape(-1, a.shape[-1]).any(axis=0))
        if cols.size:
            width = max(width, int(cols[-1]) + 1)
    for ph, v in tables:
        phases[ph][v] = np.ascontiguousarray(phases[ph][v][..., :width])
