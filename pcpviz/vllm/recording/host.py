"""Copies of vLLM's tensors taken when a hook fires, moved to the host once per step.

A hook clones what it records on its device (``copy_now``): vLLM's persistent buffers are
overwritten by the next step (and CUDA graphs replay them by address, so they are never
re-allocated). At the end of the step ``host_all`` moves every view of the step to NumPy
with two device synchronisations in all, and ``trim_block_tables`` cuts the block-table
views to the columns in use.

Block-table rows as a forward pass sees them (``block_rows``), PCP=2, block size 4, a
request with 6 tokens (2 blocks) in a persistent row that held a 3-block request before::

    row in the gathered table   [7, 9, 4, 0, ...]     (4: left over from the previous occupant)
    num_blocks of the request   2
    recorded row                [7, 9, 0, 0, ...]     stale = 1
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

__all__ = ["copy_now", "to_host", "host_all", "now_us", "block_rows", "trim_block_tables"]


def copy_now(value: Any) -> Any:
    """A copy taken now: tensors are cloned on their device (moved at step end)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def to_host(value: Any) -> Any:
    """A tensor (or a list of tensors, stacked) as a NumPy array; bfloat16 as float32."""
    if isinstance(value, torch.Tensor):
        value = value.cpu()
        return value.numpy() if value.dtype != torch.bfloat16 else value.float().numpy()
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return np.stack([to_host(v) for v in value])
    return value


def host_all(phases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every view of a step on the host, with two device synchronisations for the whole step
    instead of one per view: after a device-wide sync (the clones may sit on any of vLLM's
    streams), device tensors are copied into pinned host memory without blocking (PyTorch's
    caching host allocator reuses the buffers), then the step's copies are awaited once."""
    staged: dict[str, dict[str, Any]] = {}
    synced = False
    if torch.cuda.is_available() and any(isinstance(x, torch.Tensor) and x.is_cuda
                                         for views in phases.values() for x in views.values()):
        torch.cuda.synchronize()  # the clones may sit on any of vLLM's streams
    for name, views in phases.items():
        if not views:
            continue
        out = staged[name] = {}
        for v, x in views.items():
            if isinstance(x, torch.Tensor) and x.is_cuda:
                buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                buf.copy_(x, non_blocking=True)
                out[v] = buf
                synced = True
            else:
                out[v] = x
    if synced:
        torch.cuda.current_stream().synchronize()
    return {name: {v: to_host(x) for v, x in views.items()} for name, views in staged.items()}


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
