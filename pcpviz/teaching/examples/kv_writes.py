"""Notebook 02's computations: which (token, slot) pairs a rank's KV cache receives in the
target forward (``cache_writes``), what a replicated draft decode writes and reads
(``draft_decode_io``), and the notebook's worked example (``block_example``).

PCP=2, block size 4: request ``a`` owns blocks [7, 3]; its draft_1 at position 6 writes slot
3*4 + 2 = 14 whether or not the block-table gather ran, but reads the null block without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pcpviz.reference.blocks import PAD_SLOT_ID, BlockTable, draft_decode_slot_mapping
from pcpviz.reference.layout import PCPLayout, plan_layout

__all__ = ["CacheWrites", "cache_writes", "DraftDecodeIO", "draft_decode_io", "BlockExample", "block_example"]


@dataclass(frozen=True)
class CacheWrites:
    """The rows one rank's KV-cache write receives in the target (or draft-prefill) forward.

    ``tokens[i]`` is the global token whose KV row ``i`` carries, ``source_rank[i]`` the rank
    that computed it, ``slots[i]`` where it is written (PAD = -1: not written)."""

    rank: int
    tokens: np.ndarray  # int64[M]
    source_rank: np.ndarray  # int64[M]
    slots: np.ndarray  # int64[M]

    def written(self) -> dict[int, int]:
        """{global token: slot} of the rows actually written."""
        keep = self.slots != PAD_SLOT_ID
        return dict(zip(self.tokens[keep].tolist(), self.slots[keep].tolist()))

    def summary(self) -> str:
        """One line: how many tokens this rank's cache receives, from its own rows and from others."""
        real = self.slots != PAD_SLOT_ID
        own = real & (self.source_rank == self.rank)
        times = "once each" if int(real.sum()) == len(self.written()) else "some more than once"
        return (f"rank {self.rank}: writes {len(self.written())} tokens ({times}); from its own rows "
                f"{self.tokens[own].tolist()}, all-gathered from other ranks {self.tokens[real & ~own].tolist()}")


def cache_writes(layout: PCPLayout, gathered_slots: np.ndarray, rank: int) -> CacheWrites:
    """What rank ``rank`` writes into its own KV replica, as ``_gather_prefill_cache_inputs`` does.

    ``gathered_slots`` is one group's ``[N*P]`` mapping (``blocks.gathered_slot_mapping``).

    * sharded decodes (DCP = 1, vLLM's default): every local row is all-gathered and written
      through the whole ``[N*P]`` mapping; the mask made padding rows PAD;
    * replicated decodes (DCP > 1): the rank writes **its own** local decode rows with rank 0's
      slots (``rank_slot_mappings[0, :num_decode_tokens]``) and all-gathers only the prefill rows.
      The write mask therefore matters only for the gathered prefill rows (duplicates of a
      replicated short prefill) and for which copy ``hidden_restore_idx`` picks.

    PCP=2, DCP=2, batch ``d1, p13`` (decode first): both ranks hold the decode; rank 1's cache
    gets the decode's KV from rank 1's own row, at the slot rank 0's copy is mapped to::

        >>> lay = plan_layout([1, 13], [False, True], 2, shard_decode_requests=False, dcp_world_size=2)
        >>> w = cache_writes(lay, np.arange(lay.padded_gather_idx.size) + 100, 1)
        >>> int(w.tokens[0]), int(w.source_rank[0]), int(w.slots[0])
        (0, 1, 100)
    """
    layout.check_rank(rank)
    n, p = layout.pcp_world_size, layout.padded_num_tokens
    slots = np.asarray(gathered_slots, dtype=np.int64).reshape(-1)
    if slots.shape[0] != n * p:
        raise ValueError(f"gathered slot mapping has {slots.shape[0]} rows, the layout has N*P = {n * p}")
    gidx = layout.padded_gather_idx
    src = np.repeat(np.arange(n, dtype=np.int64), p)
    if layout.shard_decode_requests:
        return CacheWrites(rank, gidx.copy(), src, slots.copy())
    # Replicated decodes: equal on every rank, first in every rank's rows.
    decode_reqs = ~layout.is_prefilling
    nd = sum(s.num_tokens for s in layout.segments_by_rank[rank] if decode_reqs[s.global_req_idx])
    if nd == p:
        return CacheWrites(rank, gidx[rank * p: rank * p + nd].copy(), np.full(nd, rank), slots[:nd].copy())
    prefill_rows = (np.arange(n * p) % p) >= nd
    tokens = np.concatenate([gidx[rank * p: rank * p + nd], gidx[prefill_rows]])
    source = np.concatenate([np.full(nd, rank, dtype=np.int64), src[prefill_rows]])
    out = np.concatenate([slots[:nd], slots[prefill_rows]])
    return CacheWrites(rank, tokens, source, out)


@dataclass(frozen=True)
class DraftDecodeIO:
    """One replicated draft decode step: where it writes and what its attention reads."""

    slot_mapping: np.ndarray  # int64[R]: from the request-indexed table through idx_mapping
    block_rows: np.ndarray  # int32[R, W]: input_block_tables[:R], the rows attention reads
    read_blocks: tuple[tuple[int, ...], ...]  # per request, the blocks its context spans

    def summary(self, names: Sequence[str]) -> str:
        return "\n".join(f"{name}: writes slot {int(s)}, reads blocks {list(b)}"
                         for name, s, b in zip(names, self.slot_mapping, self.read_blocks))


def draft_decode_io(table: np.ndarray, block_size: int, idx_mapping: np.ndarray, *, positions: np.ndarray,
                    input_block_tables: np.ndarray) -> DraftDecodeIO:
    """A draft decode's writes and reads, the way vLLM 0.33.0 splits them.

    * **writes**: ``BlockTables.compute_slot_mappings`` reads the persistent, request-indexed
      table (``block_table_ptrs``) through ``idx_mapping`` — it never looks at
      ``input_block_tables``, so its slots are right with or without the gather;
    * **reads**: the draft attention metadata takes ``block_tables=input_block_tables[:R]``,
      which only ``gather_block_tables(idx_mapping)`` in ``propose`` fills under PCP.

    ``input_block_tables`` is what that buffer holds when the step runs (the gathered rows, or
    zeros / a previous step's rows when the gather is skipped). Example (block size 4, request
    ``a`` in request-state slot 2 owning blocks [7, 3], at position 6)::

        >>> t = np.zeros((4, 2), np.int32); t[2] = [7, 3]
        >>> io = draft_decode_io(t, 4, np.array([2]), positions=np.array([6]),
        ...                      input_block_tables=np.zeros((4, 2), np.int32))
        >>> io.slot_mapping.tolist(), io.read_blocks
        ([14], ((0, 0),))
    """
    idx = np.asarray(idx_mapping, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    r = idx.shape[0]
    slots = draft_decode_slot_mapping(table, block_size, idx, positions=pos)[0]
    rows = np.asarray(input_block_tables)[:r].astype(np.int32)
    reads = tuple(tuple(int(b) for b in rows[i, : int(pos[i]) // block_size + 1]) for i in range(r))
    return DraftDecodeIO(slots, rows, reads)


@dataclass(frozen=True)
class BlockExample:
    """Notebook 02's example: block size 4, PCP=2; ``a`` (fresh 6-token prefill) lives in
    request-state slot 2 with blocks [7, 3], ``b`` (decode at position 2) in slot 0 with [5]."""

    names: tuple[str, ...]
    table: BlockTable
    block_size: int
    idx_mapping: np.ndarray  # int64[R]: batch row -> request-state slot
    query_start_loc: np.ndarray  # int64[R+1]
    positions: np.ndarray  # int64[T]
    layout: PCPLayout
    draft_positions: np.ndarray  # int64[R]: draft_1's positions
    stale_input_block_tables: np.ndarray  # int32[max_reqs, W]: what PCP leaves there (zeros)


def block_example() -> BlockExample:
    table = BlockTable(max_num_reqs=4, max_blocks_per_req=4)
    table.append(2, [7, 3])
    table.append(0, [5])
    return BlockExample(
        names=("b", "a"), table=table, block_size=4, idx_mapping=np.array([0, 2]),
        query_start_loc=np.array([0, 1, 7]), positions=np.array([2, 0, 1, 2, 3, 4, 5]),
        layout=plan_layout([1, 6], [False, True], 2), draft_positions=np.array([3, 6]),
        stale_input_block_tables=np.zeros((4, 4), np.int32),
    )
