"""Every row of one step's batch decoded in one pass: ``decode_step_rows(ix, i, shared, ...)``
is ``reader.Trace._decode(ix, i, None, share=True)`` as a list by row (the same arrays, crc32
checks, arrays shared between ranks and first error), the rows walked by one ``zip`` over the
layout's per-row lists instead of index look-ups: the checks' runner reads every row of every
step, 7 million rows on a 100,000-step PCP=2 trace.

A PCP=2 step whose ``target`` records ``positions`` int64[3] and ``req_ids`` str[1] on both
ranks: rank 0 gives ``[array([0, 1, 2]), array(['a'])]``, each row checked against its crc32;
rank 1, asked next with the same ``shared`` dict, gets rank 0's very arrays where its payload
bytes are the same (a memcmp instead of a crc32), so a check of a global view runs once.
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np

from .batches import row_plan, same_bytes
from .errors import TraceError
from .index import RankIndex


def decode_step_rows(ix: RankIndex, i: int, shared: dict, *, slow_row: Callable) -> list:
    """The arrays of every row of step ``ix.steps[i]``, in row order. ``shared``: (row prefix,
    shape, crc32) -> (payload bytes, array) of the rows other ranks decoded in this step (added
    to); ``slow_row(ix, step, phase, view, layout, j, shape, stored)``: a string row, or a
    numeric one that does not fit its dtype and shape (``reader``'s ``_decode_row``)."""
    loaded = ix.batch(i)
    layout, step = ix.layouts[i], int(ix.steps[i])
    u8, mv, offsets, step_crc = loaded.u8, loaded.mv, loaded.offsets, loaded.step_crc
    heads, wants = row_plan(layout, loaded.shapes)  # per row: its crc32 head, a numeric row's size
    out: list = []
    crc32, ndarray, get = zlib.crc32, np.ndarray, shared.get
    rows = zip(layout.prefixes, loaded.shapes, loaded.crcs, offsets, offsets[1:], heads, wants, layout.dtypes)
    for j, (prefix, shape, crc, start, stop, head, want, dt) in enumerate(rows):
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
            value = slow_row(ix, step, layout.phase_of[j], layout.views[j], layout, j, shape, u8[start:stop])
        out.append(value)
        shared[key] = (stored, value)
    return out
