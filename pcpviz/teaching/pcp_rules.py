"""Three small rules of vLLM 0.33.0's replicated draft steps under PCP, computed (no vLLM import).

* ``draft_decode_mapping``: a replicated draft decode's slot mapping is as long as the draft
  batch's **padded** token count (``batch_desc.num_tokens``: R eager, the graph size under a
  CUDA graph), PAD past the R real rows; ``_gather_prefill_cache_inputs`` writes locally because
  ``slot_mapping.shape[0] <= local rows`` (the K rows are padded the same way), not because the
  length is R;
* ``input_block_table_gather``: which rows of the shared ``input_block_tables`` one
  ``gather_block_tables(idx_mapping, num_reqs_padded)`` writes and zeroes (review risk 1's
  ``num_reqs_padded``);
* ``indexer_compressed_slice``: the rows of the slot mapping the sparse-indexer metadata builder
  keeps for its compressed slots when ``compress_ratio > 1`` (``if self.use_pcp:`` divides the
  length by the PCP size with no shape check; the third length-based mode decision).

Tests hold the first two to vLLM's own kernels (``BlockTables.compute_slot_mappings``,
``gather_block_tables``, ``_gather_prefill_cache_inputs``); the third is read from the builder
(``v1/attention/backends/mla/indexer.py``), which needs a DeepSeek-V4-type model to run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pcpviz.reference.blocks import compute_slot_mappings

__all__ = ["DraftDecodeMapping", "draft_decode_mapping", "GatherRows", "input_block_table_gather",
           "IndexerSlice", "indexer_compressed_slice"]


@dataclass(frozen=True)
class DraftDecodeMapping:
    """One replicated draft decode step's KV-write mapping and the rows it is written with."""

    num_reqs: int
    slots: np.ndarray  # int64[G, num_tokens_padded]: PAD past num_reqs
    local_rows: int  # rows of the layer's K tensor: the same padded token count

    @property
    def num_tokens_padded(self) -> int:
        return int(self.slots.shape[-1])

    @property
    def writes_locally(self) -> bool:
        """``_gather_prefill_cache_inputs``'s test: ``slot_mapping.shape[0] <= local_num_tokens``."""
        return self.num_tokens_padded <= self.local_rows


def draft_decode_mapping(table: np.ndarray, block_size: int, idx_mapping: np.ndarray, *,
                         positions: np.ndarray, num_tokens_padded: int) -> DraftDecodeMapping:
    """``compute_slot_mappings(idx_mapping, arange(R+1), positions, num_tokens_padded)`` as the
    draft decodes call it. PCP=2, block size 4, requests in slots 0 ([5]) and 2 ([7, 3]) at
    positions 3 and 6, a CUDA graph of 4 requests::

        >>> t = np.zeros((4, 2), np.int32); t[0, 0] = 5; t[2] = [7, 3]
        >>> m = draft_decode_mapping(t, 4, np.array([0, 2]), positions=np.array([3, 6]), num_tokens_padded=4)
        >>> m.slots.tolist(), m.writes_locally
        ([[23, 14, -1, -1]], True)
    """
    idx = np.asarray(idx_mapping, dtype=np.int64)
    r = idx.shape[0]
    if num_tokens_padded < r:
        raise ValueError(f"num_tokens_padded {num_tokens_padded} < {r} requests")
    slots = compute_slot_mappings(table, block_size, idx, query_start_loc=np.arange(r + 1),
                                  positions=np.asarray(positions), num_tokens_padded=num_tokens_padded)
    return DraftDecodeMapping(r, slots, int(num_tokens_padded))


@dataclass(frozen=True)
class GatherRows:
    """Rows of ``input_block_tables`` after one gather into it: ``[0, written)`` hold the batch's
    request rows, ``[written, zeroed_until)`` were zeroed, the rest were left as they were."""

    written: int
    zeroed_until: int
    dirty_after: int  # what the next gather (or BlockTables.get_dummy_block_tables) zeroes up to


def input_block_table_gather(num_reqs: int, num_reqs_padded: int, *, dirty_rows: int) -> GatherRows:
    """``BlockTables.gather_block_tables(idx_mapping, num_reqs_padded)`` into the shared buffer:
    the kernel runs ``max(num_reqs_padded, dirty_rows)`` programs, writes the first ``num_reqs``
    (a request's row up to its block count) and zeroes the rest; ``dirty_rows`` becomes ``num_reqs``.
    MTP's ``propose`` passes ``num_reqs_padded=num_reqs``, so a 2-request draft step after a
    5-request one zeroes rows 2-4 (graph padding rows then read the null block)::

        >>> input_block_table_gather(2, 2, dirty_rows=5)
        GatherRows(written=2, zeroed_until=5, dirty_after=2)
    """
    if num_reqs < 0 or num_reqs_padded < 0 or dirty_rows < 0:
        raise ValueError("row counts must be >= 0")
    return GatherRows(num_reqs, max(num_reqs, num_reqs_padded, dirty_rows), num_reqs)


@dataclass(frozen=True)
class IndexerSlice:
    """The slot-mapping rows the indexer builder hands ``get_compressed_slot_mapping``."""

    start: int
    stop: int
    num_tokens: int  # the metadata's num_actual_tokens

    @property
    def covers_the_tokens(self) -> bool:
        return self.stop - self.start >= self.num_tokens


def indexer_compressed_slice(slot_mapping_rows: int, *, num_tokens: int, pcp: int, rank: int,
                             use_pcp: bool = True) -> IndexerSlice:
    """``compress_ratio > 1``: ``padded = len // pcp`` and rows ``[rank * padded, (rank+1) * padded)``
    whenever ``use_pcp``; right on the target's expanded ``[N*P]`` mapping, short on a replicated
    draft decode's unexpanded one. PCP=2, 3 draft-decode rows on rank 1::

        >>> indexer_compressed_slice(8, num_tokens=4, pcp=2, rank=1).covers_the_tokens
        True
        >>> s = indexer_compressed_slice(3, num_tokens=3, pcp=2, rank=1); (s.start, s.stop, s.covers_the_tokens)
        (1, 2, False)
    """
    if not 0 <= rank < pcp:
        raise ValueError(f"rank {rank} out of range for PCP {pcp}")
    if not use_pcp:
        return IndexerSlice(0, slot_mapping_rows, num_tokens)
    padded = slot_mapping_rows // pcp
    return IndexerSlice(rank * padded, (rank + 1) * padded, num_tokens)

