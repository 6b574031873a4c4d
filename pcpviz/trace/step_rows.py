"""Every row of one step's batch decoded in one pass: ``decode_step_rows(ix, i, shared, ...)``
is ``reader.Trace._decode(ix, i, None, share=True)`` as a list by row (the same arrays, crc32
checks, arrays shared between ranks and first error), the rows walked by one ``zip`` over the
layout's per-row lists instead of index look-ups: the checks' runner reads every row of every
step, 7 million rows on a 100,000-step PCP=2 trace.

A PCP=2 step whose ``target`` records ``positions`` int64[3] and ``req_ids`` str[1] on both
ranks: rank 0 gives ``[array([0, 1, 2]), array(['a'])]``, each row checked against its crc32;
rank 1, asked next with the same ``shared`` dict, gets rank 0's very arrays where its payload
bytes are the same (a memcmp instead of a crc32), so a check of a global view runs once. A batch
whose index and payload bytes are those of a batch decoded before in the step (``diff``'s run B
where it recorded what run A did) is that batch's arrays at once (``_WHOLE``).
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np

from .batches import Loaded, row_plan, same_bytes
from .errors import TraceError
from .index import RankIndex


def decode_step_rows(ix: RankIndex, i: int, shared: dict, *, slow_row: Callable, whole: bool = False) -> list:
    """The arrays of every row of step ``ix.steps[i]``, in row order. ``shared``: (row prefix,
    shape, crc32) -> (payload bytes, array) of the rows other ranks decoded in this step (added
    to); ``slow_row(ix, layout, j, step=, shape=, stored=)``: a string row, or a
    numeric one that does not fit its dtype and shape (``row_views.decode_row``); ``whole``:
    first look for a batch of the same bytes (``_WHOLE``: two runs of one step, not two ranks,
    whose rank-local rows differ)."""
    loaded = ix.batch(i)
    layout, step = ix.layouts[i], int(ix.steps[i])
    crcs, keys, before = loaded.crcs, (), None
    if whole:
        keys = ((_WHOLE, loaded.values.size, tuple(crcs)), (_WHOLE, loaded.values.size))
        for prefixes, seen, arrays in shared.get(keys[0], ()):  # the same crc32s: the same bytes?
            if prefixes == layout.prefixes and seen.shapes == loaded.shapes and seen.offsets == loaded.offsets \
                    and seen.values.equals(loaded.values):
                return list(arrays)  # every row as another run recorded it: its arrays
        for prefixes, seen, arrays in shared.get(keys[1], ())[:_RUNS_TRIED]:  # the same size: rows alike?
            if prefixes == layout.prefixes and seen.shapes == loaded.shapes and seen.offsets == loaded.offsets:
                before = _same_runs(seen, loaded, arrays)
                break
    u8, mv, offsets, step_crc = loaded.u8, loaded.mv, loaded.offsets, loaded.step_crc
    heads, wants = row_plan(layout, loaded.shapes)  # per row: its crc32 head, a numeric row's size
    out: list = []
    crc32, ndarray, get = zlib.crc32, np.ndarray, shared.get
    rows = zip(layout.prefixes, loaded.shapes, loaded.crcs, offsets, offsets[1:], heads, wants, layout.dtypes)
    for j, (prefix, shape, crc, start, stop, head, want, dt) in enumerate(rows):
        if before is not None and before[j] is not None:
            out.append(before[j])
            continue
        stored = mv[start:stop]  # the row's bytes, read-only, no copy
        key = (prefix, shape, crc)  # the prefix names the row's phase, view and dtype
        seen = get(key)
        if seen is not None and same_bytes(seen[0], stored):
            out.append(seen[1])
            continue
        if crc32(stored, crc32(head, step_crc)) != crc:
            raise TraceError(f"{ix.path}: step {step}: view {layout.views[j]!r} (phase {layout.phase_of[j]!r}): "
                             "corrupt data (crc32 mismatch)")
        if stop - start == want:  # a numeric row that fits its dtype and shape
            value = ndarray(shape, dt, u8, start)  # read-only: u8 is
        else:
            value = slow_row(ix, layout, j, step=step, shape=shape, stored=u8[start:stop])
        out.append(value)
        shared[key] = (stored, value)
    for key in keys:
        shared.setdefault(key, []).append((layout.prefixes, loaded, out))
    return out


def _same_runs(seen: Loaded, loaded: Loaded, arrays: list) -> list:
    """Per row of ``loaded``, ``seen``'s array where the row lies in a run of consecutive rows whose
    crc32s are the same in both batches and whose bytes are (one comparison per run; the batches
    have the same rows, shapes and offsets), else None: run B's step where a few views differ
    from run A's."""
    out: list = [None] * len(arrays)
    same = [a == b for a, b in zip(seen.crcs, loaded.crcs)] + [False]
    offsets, j = loaded.offsets, 0
    while j < len(arrays):
        if not same[j]:
            j += 1
            continue
        k = same.index(False, j)  # rows j .. k-1: one run
        if seen.mv[offsets[j]:offsets[k]] == loaded.mv[offsets[j]:offsets[k]]:
            out[j:k] = arrays[j:k]
        j = k
    return out


_WHOLE = "whole batch"
"""The first item of the ``shared`` keys naming whole batches: (``_WHOLE``, payload size, crc32s)
and (``_WHOLE``, payload size) -> [(row prefixes, the loaded batch, its arrays by row)] of the
batches decoded in the step. A batch of the same index and bytes as one of them (another run's,
in ``diff``) is that batch's arrays, in one comparison of the payload buffers instead of one per
row; one of the same rows and offsets whose bytes differ somewhere takes the arrays of one such
batch for each run of rows whose crc32s and bytes are the same (``_same_runs``)."""

_RUNS_TRIED = 2
"""Batches of the same size tried for ``_same_runs``, at most: at PCP=64 a step has 128 batches of
one size (both runs' ranks), and trying each would cost more than decoding the rows."""
