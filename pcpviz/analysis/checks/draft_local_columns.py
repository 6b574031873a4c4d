"""``draft_prefill_rank_local``'s bulk rule read as columns: the MTP draft prefill of each step
reuses the target's rank-local rows, so each of its four views equals its target twin, shape
and values (``slot_mapping_draft`` the gathered slot mapping, ``draft_positions`` the local
positions, ``draft_seq_lens`` the local seq lens, ``block_table_draft`` the local block table),
compared for a whole block with NumPy instead of one ``same_values`` per view per step.

A PCP=2 step on rank 1 with ``local_positions`` ``[4, 5, 6, 7]`` and ``draft_positions``
``[4, 5, 6, 7]``, ``slot_mapping_gathered`` ``[[20, 21, 22, 23]]`` (one KV-cache group) and
``slot_mapping_draft`` ``[20, 21, 22, 23]`` (the same group, recorded 1-D), ``view``
``"rank_local"``: passes. ``draft_positions`` ``[4, 5, 6]`` (a length off) does not.

Where a view has no column (floats, strings, another number of axes somewhere in the block)
``rank_local_cols`` gives None and the per-step rule judges.
"""

from __future__ import annotations

import numpy as np

from pcpviz.trace.shapes import view_text

from .columns import Block, Column, all_per_step, ragged

RANK_LOCAL_COLS = (("slot_mapping_draft", "slot_mapping_gathered", "slots"),
                   ("draft_positions", "local_positions", ""),
                   ("draft_seq_lens", "local_seq_lens", ""),
                   ("block_table_draft", "block_table_local", "table"))
"""(draft_0's view, its target twin, how both are normalised: ``slots`` as ``slot_groups``
([n] -> [1, n]), ``table`` as ``table_groups`` ([rows, W] -> [1, rows, W]), else as recorded)."""


def _dims(col: Column, norm: str) -> np.ndarray:
    """int64[n, k]: each step's shape after the check's normalisation."""
    one = np.ones((col.dims.shape[0], 1), dtype=np.int64)
    if (norm == "slots" and col.ndim == 1) or (norm == "table" and col.ndim == 2):
        return np.concatenate([one, col.dims], axis=1)
    return col.dims


def rank_local_cols(b: Block, rank: int) -> np.ndarray | None:
    """bool[n]: where ``_draft_prefill_rank_local_bulk``'s per-step loop says True (draft_0
    recorded, its ``view`` where recorded ``rank_local``, every twin pair recorded on both sides
    equal, one thing compared); None where a view of the pairs has no column."""
    n = len(b)
    has = np.fromiter(("draft_0" in sv.recs.get(rank, ()) for sv in b.svs), dtype=bool, count=n)
    checked, good = np.zeros(n, dtype=bool), np.ones(n, dtype=bool)
    for dview, tview, norm in RANK_LOCAL_COLS:
        d = b.col(rank, "draft_0", dview, ndim=None, bools=True)
        t = b.col(rank, "target", tview, ndim=None, bools=True)
        if d is None or t is None:
            return None
        both = d.present & t.present
        dd, td = _dims(d, norm), _dims(t, norm)
        same = ((dd == td).all(axis=1) if dd.shape[1] == td.shape[1] else np.zeros(n, dtype=bool)) & both
        step, k = ragged(np.where(same, d.lens, 0))
        same &= all_per_step(d.at(step, k)[0] == t.at(step, k)[0], step, n)
        checked |= both
        good &= same | ~both
    texts: dict[int, bool] = {}  # id of a view array -> it reads "rank_local" (the reader shares equal ones)
    for i, view in enumerate(b.arrays(rank, "draft_0", "view")):
        if view is not None and has[i]:
            ok = texts.get(id(view))
            if ok is None:
                ok = texts[id(view)] = view_text(view) == "rank_local"
            checked[i] = True
            good[i] &= ok
    return has & checked & good
