"""DualChunkSwap chunks: how each row's query is cut, which rank computes each piece, and the
maps that gather the pieces back (vLLM 0.33.0's ``replicated_requests``, ``_iter_rank_chunks``
and ``_get_rank_segments`` of ``PCPManager._build_batch_layout``, re-derived).

``pcpviz.reference.layout.plan_layout`` validates a batch and assembles these into a
``PCPLayout``; the synthetic producer calls them directly to build faulted layouts.

PCP=2, a 13-token prefill ``p0`` then a 1-token decode ``d1`` (sharded): ``p0`` is cut into
2N = 4 chunks of ``ceil(13/4) = 4`` tokens, rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2;
``d1`` is decode #0, so rank 0 owns it and puts it first::

    >>> q, pf = np.array([13, 1]), np.array([True, False])
    >>> segs = rank_segments(q, pf, np.array([0, 13, 14]), replicated=replicated_requests(q, pf, 2),
    ...                      n=2, shard=True)
    >>> [[(s.global_req_idx, s.global_start, s.global_stop) for s in r] for r in segs]
    [[(1, 13, 14), (0, 0, 4), (0, 12, 13)], [(0, 4, 8), (0, 8, 12)]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Segment", "chunk_size", "replicated_requests", "dual_chunk_swap", "rank_segments", "gather_maps"]


@dataclass(frozen=True)
class Segment:
    """One contiguous run of a request's query tokens placed on one rank.

    ``global_start:global_stop`` indexes the global (scheduler-ordered) token
    axis; ``local_start:local_stop`` indexes the rank's local token axis.
    """

    global_req_idx: int
    global_start: int
    global_stop: int
    local_start: int
    local_stop: int

    @property
    def num_tokens(self) -> int:
        return self.global_stop - self.global_start


def chunk_size(query_len: int, pcp_world_size: int) -> int:
    """``ceil(query_len / 2N)``: the length of each of a split row's 2N chunks (the last may be shorter)."""
    num_chunks = 2 * pcp_world_size
    return (query_len + num_chunks - 1) // num_chunks


def replicated_requests(
    num_scheduled_tokens: np.ndarray, is_prefilling: np.ndarray, pcp_world_size: int, *,
    dcp_world_size: int = 1,
) -> np.ndarray:
    """bool[R]: rows that are not DualChunkSwap-split (decodes, and under DCP the
    prefills too short to give every rank two non-empty chunks)."""
    q = np.asarray(num_scheduled_tokens, dtype=np.int64)
    replicated = ~np.asarray(is_prefilling, dtype=np.bool_)
    if dcp_world_size > 1:
        num_chunks = 2 * pcp_world_size
        chunk = (q + num_chunks - 1) // num_chunks
        replicated = replicated | ((num_chunks - 1) * chunk >= q)
    return replicated


def dual_chunk_swap(rank: int, pcp_world_size: int) -> tuple[int, int]:
    """The two of the 2N chunks rank r computes: ``(r, 2N-1-r)``."""
    return (rank, 2 * pcp_world_size - 1 - rank)


def _rank_chunks(
    rank: int, q: np.ndarray, replicated: np.ndarray, pcp_world_size: int, shard_decodes: bool,
    chunk_ids=dual_chunk_swap,
) -> list[tuple[int, int, int]]:
    """(global row, query offset, length) of every non-empty chunk ``rank`` computes,
    in global row order. ``chunk_ids(rank, N)`` picks a split row's chunks."""
    out = []
    decode_ordinal = 0
    for req, query_len in enumerate(q.tolist()):
        if query_len == 0:
            continue
        if not replicated[req]:
            size = chunk_size(query_len, pcp_world_size)
            ids: tuple[int, ...] = tuple(chunk_ids(rank, pcp_world_size))
        elif shard_decodes:
            size = query_len
            # Ownership only needs to balance this step: KV and hidden states are
            # gathered back to every rank, so a compact decode-only ordinal is used.
            ids = (0,) if decode_ordinal % pcp_world_size == rank else ()
            decode_ordinal += 1
        else:
            size = query_len
            ids = (0,)
        for chunk_id in ids:
            offset = chunk_id * size
            length = min(size, query_len - offset)
            if length > 0:
                out.append((req, offset, length))
    return out


def rank_segments(
    q: np.ndarray, prefill: np.ndarray, qsl: np.ndarray, *, replicated: np.ndarray, n: int, shard: bool,
    chunk_ids=dual_chunk_swap,
) -> tuple[tuple[Segment, ...], ...]:
    """Every rank's segments, decodes first, with their local offsets."""
    out = []
    for rank in range(n):
        chunks = _rank_chunks(rank, q, replicated, n, shard, chunk_ids)
        # Decodes first, then prefills; the sort is stable on (prefill, row, start).
        chunks.sort(key=lambda c: (bool(prefill[c[0]]), c[0], c[1]))
        segs, local = [], 0
        for req, offset, length in chunks:
            start = int(qsl[req]) + offset
            segs.append(Segment(req, start, start + length, local, local + length))
            local += length
        out.append(tuple(segs))
    return tuple(out)


def gather_maps(
    segments_by_rank, p: int, num_tokens: int, *, prefill: np.ndarray, replicated: np.ndarray,
    shard: bool, writer_rank: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(padded_gather_idx int64[N*P], hidden_restore_idx int64[T] (-1 = no writer),
    kv_write_mask bool[N*P]) for segments padded to P rows per rank. Replicated rows are
    written by ``writer_rank`` (vLLM: rank 0); a sharded decode by its owner."""
    n = len(segments_by_rank)
    padded_gather_idx = np.zeros(n * p, dtype=np.int64)
    kv_write_mask = np.zeros(n * p, dtype=np.bool_)
    hidden_restore_idx = np.full(num_tokens, -1, dtype=np.int64)
    for rank, segs in enumerate(segments_by_rank):
        base = rank * p
        for seg in segs:
            rows = np.arange(base + seg.local_start, base + seg.local_stop, dtype=np.int64)
            padded_gather_idx[rows] = np.arange(seg.global_start, seg.global_stop)
            req = seg.global_req_idx
            sharded_decode = shard and not prefill[req]
            # Replicated rows hold identical KV on every rank: one rank writes it.
            if replicated[req] and not sharded_decode and rank != writer_rank:
                continue
            kv_write_mask[rows] = True
            hidden_restore_idx[seg.global_start : seg.global_stop] = rows
    return padded_gather_idx, hidden_restore_idx, kv_write_mask
