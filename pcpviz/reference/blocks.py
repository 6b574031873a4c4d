"""Block tables and slot mappings: the NumPy reference of vLLM 0.33.0's
``BlockTables`` (``vllm/v1/worker/gpu/block_table.py``) and of the PCP manager's
gathered slot mapping.

A KV *slot* is ``block_id * block_size + offset``. Block 0 is vLLM's null block:
never allocated, and what a zeroed block-table entry points at.

Three slot mappings appear in one PCP+MTP step (PAD = -1 means "write nothing"):

* ``global``  ``[G, T]``   one slot per global token (``compute_slot_mappings`` on
  the global batch);
* ``gathered`` ``[G, N*P]`` the global mapping reordered into the all-gathered
  rank-major row order (``padded_gather_idx``), PAD where ``kv_write_mask`` is
  False, so each slot is written once per KV replica;
* ``draft``   ``[G, R]``   the replicated draft decodes (steps 1..K-1): one token
  per request, *unexpanded*. These are the R real columns: vLLM's mapping is
  ``[G, num_tokens]``, PAD past R up to the padded draft batch (CUDA graphs, DP).
  The attention layer writes locally because the mapping is no longer than its
  own, equally padded rows (vLLM's ``v1/attention/ops/pcp.py:29``), not because
  its length is R.

PCP=2 example (block_size 4; decode b in request-state slot 0 owns block [5], request a in
slot 2 owns blocks [7, 3]; vLLM orders the decode first)::

    global batch   b: decode at position 2        a: fresh prefill, positions 0..5
    idx_mapping    [0, 2]                          (batch row -> request-state slot)
    global slots   [22 | 28 29 30 31 12 13]                                T = 7
    layout         a is cut in 4 chunks of 2: [0:2] [2:4] [4:6] [6:6]
                   rank 0 rows: b, a[0:2]   (decodes first)     3 tokens
                   rank 1 rows: a[2:4], a[4:6]                  4 tokens   P = 4
    gathered       [22 28 29 -1 | 30 31 12 13]        (rank 0's padding row is PAD)
    draft decode   b at position 3, a at 6  ->  [23 14]       (length R = 2)

The draft decode's slots come from the request-indexed table through ``idx_mapping``;
what its attention *reads* is the separate ``input_block_tables`` buffer (see
``draft_decode_slot_mapping``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from pcpviz.reference.layout import PCPLayout

__all__ = [
    "PAD_SLOT_ID",
    "BlockAllocator",
    "BlockTable",
    "compute_slot_mappings",
    "gather_block_table_rows",
    "gathered_slot_mapping",
    "draft_decode_slot_mapping",
]

PAD_SLOT_ID = -1
NULL_BLOCK = 0


class BlockAllocator:
    """A free-list allocator over ``num_blocks`` KV blocks; block 0 is reserved."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: allocation order is 1, 2, 3, ... on a fresh allocator.
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: need {n}, {len(self._free)} free of {self.num_blocks - 1}"
            )
        out = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        if any(b <= NULL_BLOCK or b >= self.num_blocks for b in ids):
            raise ValueError(f"cannot free blocks {ids}: outside 1..{self.num_blocks - 1}")
        self._free.extend(reversed(ids))


@dataclass
class BlockTable:
    """Per request-state slot, its list of block ids (one KV-cache group).

    ``as_array()`` gives the dense ``int32[max_num_reqs, max_blocks]`` table that
    the kernels index by request-state slot (``idx_mapping``); unused entries
    are 0 (the null block).
    """

    max_num_reqs: int
    max_blocks_per_req: int
    rows: dict[int, list[int]] = field(default_factory=dict)

    def append(self, req_slot: int, block_ids: Sequence[int]) -> None:
        self._check_slot(req_slot)
        row = self.rows.setdefault(req_slot, [])
        if len(row) + len(block_ids) > self.max_blocks_per_req:
            raise ValueError(
                f"block table row {req_slot} would hold {len(row) + len(block_ids)} blocks, "
                f"more than max_blocks_per_req={self.max_blocks_per_req}"
            )
        row.extend(int(b) for b in block_ids)

    def clear(self, req_slot: int) -> list[int]:
        self._check_slot(req_slot)
        return self.rows.pop(req_slot, [])

    def num_blocks(self, req_slot: int) -> int:
        return len(self.rows.get(req_slot, ()))

    def as_array(self) -> np.ndarray:  # int32[max_num_reqs, max_blocks_per_req]
        out = np.zeros((self.max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        for slot, row in self.rows.items():
            out[slot, : len(row)] = row
        return out

    def _check_slot(self, req_slot: int) -> None:
        if not 0 <= req_slot < self.max_num_reqs:
            raise ValueError(f"request slot {req_slot} outside 0..{self.max_num_reqs - 1}")


def gather_block_table_rows(
    table: np.ndarray, idx_mapping: np.ndarray, num_reqs_padded: int | None = None, *,
    num_blocks: np.ndarray | None = None,
) -> np.ndarray:
    """int32[num_reqs_padded, W]: the table rows of the batch's requests, in batch order.

    This is ``BlockTables.gather_block_tables``: rows past ``len(idx_mapping)``
    are zero, and only a request's first ``num_blocks[slot]`` entries are copied
    (defaults to the whole row). Under PCP the target uses it with the *local*
    ``idx_mapping`` (one row per local segment: the request's full row, since
    every rank holds the whole KV); the MTP drafter must call it again with the
    *global* ``idx_mapping`` before its replicated decodes.
    """
    table = np.asarray(table)
    idx = np.asarray(idx_mapping, dtype=np.int64)
    padded = idx.shape[0] if num_reqs_padded is None else int(num_reqs_padded)
    if padded < idx.shape[0]:
        raise ValueError(f"num_reqs_padded {padded} < {idx.shape[0]} requests")
    out = np.zeros((padded, table.shape[1]), dtype=np.int32)
    if idx.size:
        rows = table[idx]
        if num_blocks is not None:
            keep = np.arange(table.shape[1])[None, :] < np.asarray(num_blocks)[idx][:, None]
            rows = np.where(keep, rows, 0)
        out[: idx.shape[0]] = rows
    return out


def compute_slot_mappings(
    tables: np.ndarray | Sequence[np.ndarray],
    block_sizes: int | Sequence[int],
    idx_mapping: np.ndarray,
    *,
    query_start_loc: np.ndarray,
    positions: np.ndarray,
    num_tokens_padded: int | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    dcp_sharded: Sequence[bool] | None = None,
    slot_mapping_enabled: Sequence[bool] | None = None,
) -> np.ndarray:
    """int64[G, num_tokens_padded]: the KV slot of each token, per KV-cache group.

    ``BlockTables.compute_slot_mappings``: token i of batch row b at position p
    goes to ``table[idx_mapping[b], p // bs] * bs + p % bs``; entries past the
    real tokens are PAD, and so are tokens of rows with ``idx_mapping == -1``
    (dummy / graph-padding requests). ``cp_size``/``cp_rank`` are the *DCP*
    size and rank: with DCP the KV is interleaved over ranks in runs of
    ``cp_interleave`` tokens, a token not owned by ``cp_rank`` is PAD, and an
    owned one uses its rank-local position
    ``(p // (bs*cp)) * bs + (p % (bs*cp)) // (il*cp) * il + p % il``.
    """
    if isinstance(tables, np.ndarray) and tables.ndim == 2:
        tables = [tables]
    tables = [np.asarray(t) for t in tables]
    g = len(tables)
    sizes = [int(block_sizes)] * g if np.isscalar(block_sizes) else [int(b) for b in block_sizes]
    if len(sizes) != g:
        raise ValueError(f"{g} block tables but {len(sizes)} block sizes")
    sharded = [True] * g if dcp_sharded is None else list(dcp_sharded)
    enabled = [True] * g if slot_mapping_enabled is None else list(slot_mapping_enabled)
    idx = np.asarray(idx_mapping, dtype=np.int64)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    num_reqs = idx.shape[0]
    num_tokens = int(qsl[num_reqs]) if qsl.size else 0
    padded = num_tokens if num_tokens_padded is None else int(num_tokens_padded)
    out = np.full((g, max(padded, num_tokens)), PAD_SLOT_ID, dtype=np.int64)
    if num_tokens == 0:
        return out[:, :padded]

    # Row (batch index) of every real token.
    row = np.repeat(np.arange(num_reqs), np.diff(qsl[: num_reqs + 1]))
    p = pos[:num_tokens]
    req = idx[row]
    real = req >= 0
    for gi, (table, bs) in enumerate(zip(tables, sizes)):
        if cp_size == 1:
            local_p, is_local = p, np.ones_like(real)
        else:
            virtual = bs * cp_size
            voff = p % virtual
            owned = (voff // cp_interleave) % cp_size == cp_rank
            local_off = voff // (cp_interleave * cp_size) * cp_interleave + voff % cp_interleave
            local_p = np.where(sharded[gi], p // virtual * bs + local_off, p)
            is_local = np.where(sharded[gi], owned, True)
        blk_idx = local_p // bs if enabled[gi] else np.zeros_like(local_p)
        ok = is_local & real
        every = bool(ok.all())  # the common case (no DCP, no padding rows): no masked copies
        if ok.any() and int((blk_idx if every else blk_idx[ok]).max()) >= table.shape[1]:
            bad = int(np.flatnonzero(ok & (blk_idx >= table.shape[1]))[0])
            raise ValueError(
                f"token {bad} (row {int(row[bad])}, position {int(p[bad])}) needs block "
                f"index {int(blk_idx[bad])} but the block table has {table.shape[1]} columns"
            )
        if not enabled[gi]:
            out[gi, :num_tokens] = PAD_SLOT_ID
            continue
        if every:
            out[gi, :num_tokens] = table[req, blk_idx].astype(np.int64) * bs + local_p % bs
            continue
        blocks = np.zeros_like(p)
        blocks[ok] = table[req[ok], blk_idx[ok]]
        out[gi, :num_tokens] = np.where(ok, blocks * bs + local_p % bs, PAD_SLOT_ID)
    return out[:, :padded]


def gathered_slot_mapping(global_slots: np.ndarray, layout: PCPLayout) -> np.ndarray:
    """int64[G, N*P]: ``PCPManager.prepare_slot_mappings`` from the global mapping.

    Row j of the all-gathered KV (rank j // P, local row j % P) is written to
    ``global_slots[:, padded_gather_idx[j]]`` if ``kv_write_mask[j]``, else PAD.
    """
    g = np.atleast_2d(np.asarray(global_slots, dtype=np.int64))
    if g.shape[1] < layout.num_tokens:
        raise ValueError(
            f"global slot mapping has {g.shape[1]} columns, the layout has {layout.num_tokens} tokens"
        )
    if layout.padded_gather_idx.size == 0:
        return np.zeros((g.shape[0], 0), dtype=np.int64)
    picked = g[:, layout.padded_gather_idx]
    return np.where(layout.kv_write_mask[None, :], picked, PAD_SLOT_ID)


def draft_decode_slot_mapping(
    tables: np.ndarray | Sequence[np.ndarray],
    block_sizes: int | Sequence[int],
    idx_mapping: np.ndarray,
    *,
    positions: np.ndarray,
    **kwargs,
) -> np.ndarray:
    """int64[G, R]: the unexpanded slot mapping of a replicated draft decode step.

    One token per request (``query_start_loc = arange(R+1)``). Like vLLM's
    ``BlockTables.compute_slot_mappings`` (the speculator calls it with its global
    ``idx_mapping``), it reads the **request-indexed** table — ``tables`` indexed by
    request-state slot through ``idx_mapping`` — never the gathered
    ``input_block_tables``. So skipping the block-table gather before the draft decodes
    does not move these writes; it breaks what the draft attention *reads*
    (``block_tables=input_block_tables[:R]``). Every rank computes the same values and
    writes its own replica, so no gather is needed.

    Example (block size 4; slot 0 owns [5], slot 2 owns [7, 3])::

        >>> t = np.zeros((4, 2), np.int32); t[0, 0] = 5; t[2] = [7, 3]
        >>> draft_decode_slot_mapping(t, 4, np.array([0, 2]), positions=np.array([3, 6])).tolist()
        [[23, 14]]
    """
    idx = np.asarray(idx_mapping, dtype=np.int64)
    qsl = np.arange(idx.shape[0] + 1, dtype=np.int64)
    return compute_slot_mappings(tables, block_sizes, idx, query_start_loc=qsl,
                                 positions=positions, num_tokens_padded=idx.shape[0], **kwargs)
