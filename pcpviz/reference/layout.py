"""PCP DualChunkSwap planning: which global tokens each PCP rank computes, and its local batch.

This is a re-derivation of vLLM 0.33.0's ``PCPManager._build_batch_layout``
(``vllm/v1/worker/gpu/pcp_manager.py``) in plain NumPy; the conformance tests
compare it against the real package on generated batches.

The rules, for PCP size N:

* a prefill row of ``q`` tokens is cut into 2N chunks of ``ceil(q / 2N)``
  tokens; rank r takes chunks ``r`` and ``2N-1-r`` (DualChunkSwap: rank 0 gets
  the head and the tail, so causal work is balanced). Empty chunks are skipped.
* a decode row (``is_prefilling`` False) is *replicated* in vLLM's vocabulary.
  With ``shard_decode_requests`` (vLLM's default when DCP == 1) its whole query
  goes to one owner rank, ``decode_ordinal % N``, counting decodes only.
  Otherwise (DCP > 1) every rank computes it; ``kv_write_mask`` keeps rank 0's
  copy in the gathered slot mapping, while the KV write itself stores each rank's
  own decode rows at rank 0's slots (``pcpviz.teaching.examples.kv_writes.cache_writes``).
* with DCP > 1, a prefill too short to fill 2N chunks (``(2N-1)*ceil(q/2N) >= q``)
  is treated like a decode.
* each rank's rows are ordered decodes first, then prefills, by global row and
  start (the MLA backends rely on decodes-first).
* every rank pads to ``P = max(per_rank_num_tokens)`` (or the CUDA-graph size) so
  that the all-gathers have equal shapes.

Worked example, PCP=2, batch ``p13, d1, d4`` (a 13-token prefill and two decodes;
the second decode carries 3 draft tokens)::

    global tokens     0 1 2 3 4 5 6 7 8 9 10 11 12 | 13 | 14 15 16 17
    request           p0 ............................| d1 | d2 .........
    p0 chunks (4 of ceil(13/4)=4):  [0:4] [4:8] [8:12] [12:13]
                                     r0    r1    r1     r0
    decodes: d1 is decode #0 -> rank 0, d2 is decode #1 -> rank 1

    rank 0 rows  d1[13]  p0[0:4]  p0[12:13]         -> 6 tokens
    rank 1 rows  d2[14:18]  p0[4:8]  p0[8:12]       -> 12 tokens    P = 12

    padded_gather_idx  = [13, 0,1,2,3, 12, 0,0,0,0,0,0 | 14,15,16,17, 4,5,6,7, 8,9,10,11]
    kv_write_mask      = [ T  T T T T  T   F F F F F F |  T ...                          T]
    hidden_restore_idx = [1,2,3,4, 16,17,18,19, 20,21,22,23, 5, 0, 12,13,14,15]

so ``global = gathered[hidden_restore_idx]`` and, on real rows,
``gathered = global[padded_gather_idx]``. How rows are cut into chunks and given to ranks
(the segments and the three maps) is ``pcpviz.reference.chunks``; ``plan_layout`` validates
the batch and assembles them into a ``PCPLayout``, ``partition_batch`` builds one rank's batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pcpviz.reference.batch import GlobalBatch, LocalBatch
from pcpviz.reference.chunks import Segment, chunk_size, gather_maps, rank_segments, replicated_requests

__all__ = [
    "PCPLayout",
    "plan_layout",
    "partition_batch",
    "num_tokens_for_dispatch",
]


@dataclass(frozen=True, eq=False)
class PCPLayout:
    """The per-step PCP partition of one global batch (identical on every rank)."""

    pcp_world_size: int
    dcp_world_size: int
    shard_decode_requests: bool
    num_scheduled_tokens: np.ndarray  # int64[R]
    is_prefilling: np.ndarray  # bool[R]
    query_start_loc: np.ndarray  # int64[R+1]
    replicated: np.ndarray  # bool[R]: decode-like rows (not DualChunkSwap-split)
    segments_by_rank: tuple[tuple[Segment, ...], ...]
    per_rank_num_tokens: tuple[int, ...]
    padded_num_tokens: int  # P
    padded_gather_idx: np.ndarray  # int64[N*P]: gathered row -> global token (pad -> 0)
    hidden_restore_idx: np.ndarray  # int64[T]: global token -> gathered row of its written copy
    kv_write_mask: np.ndarray  # bool[N*P]: rows kept in the gathered slot mapping (others PAD)

    @property
    def num_tokens(self) -> int:
        """T, the number of global tokens."""
        return int(self.query_start_loc[-1])

    @property
    def num_reqs(self) -> int:
        return int(self.num_scheduled_tokens.shape[0])

    def local_gather_idx(self, rank: int) -> np.ndarray:
        """int64[P]: the global token each local row of ``rank`` holds (pad -> 0)."""
        self.check_rank(rank)
        p = self.padded_num_tokens
        return self.padded_gather_idx[rank * p : (rank + 1) * p]

    def is_real_row(self) -> np.ndarray:
        """bool[N*P]: gathered rows that hold a token (False for padding)."""
        p = self.padded_num_tokens
        rows = np.arange(p)
        return (rows[None, :] < np.asarray(self.per_rank_num_tokens)[:, None]).ravel()

    def token_chunk(self) -> np.ndarray:
        """int64[N*P]: DualChunkSwap chunk index of each gathered row, -1 on padding.

        Decode-like rows are one chunk (0). Useful for colouring lanes.
        """
        p = self.padded_num_tokens
        out = np.full(self.pcp_world_size * p, -1, dtype=np.int64)
        for rank, segments in enumerate(self.segments_by_rank):
            for seg in segments:
                rows = slice(rank * p + seg.local_start, rank * p + seg.local_stop)
                req = seg.global_req_idx
                if self.replicated[req]:
                    out[rows] = 0
                else:
                    chunk = chunk_size(int(self.num_scheduled_tokens[req]), self.pcp_world_size)
                    offset = seg.global_start - int(self.query_start_loc[req])
                    out[rows] = offset // chunk
        return out

    def check_rank(self, rank: int) -> None:
        """ValueError unless ``0 <= rank < pcp_world_size``."""
        if not 0 <= rank < self.pcp_world_size:
            raise ValueError(f"rank {rank} is outside PCP world size {self.pcp_world_size}")


def _as_int_array(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.floor(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{name}[{i}] = {arr[i]} is negative")
    return arr


def _as_bool_array(name: str, values: Sequence[bool] | np.ndarray, length: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(
            f"{name} must have one entry per request ({length}), got shape {arr.shape}"
        )
    if arr.size and arr.dtype != np.bool_:
        if not np.all(np.isin(arr, (0, 1))):
            raise ValueError(f"{name} must hold booleans, got {arr.dtype} values")
    return arr.astype(np.bool_)


def _check_world_size(name: str, value: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def num_tokens_for_dispatch(
    num_scheduled_tokens: Sequence[int] | np.ndarray,
    is_prefilling: Sequence[bool] | np.ndarray,
    pcp_world_size: int,
    *,
    shard_decode_requests: bool | None = None,
    dcp_world_size: int = 1,
) -> int:
    """The largest real rank-local token count: what vLLM dispatches CUDA graphs on."""
    layout = plan_layout(
        num_scheduled_tokens, is_prefilling, pcp_world_size,
        shard_decode_requests=shard_decode_requests, dcp_world_size=dcp_world_size,
    )
    return max(layout.per_rank_num_tokens)


def _padded_tokens(padded_num_tokens, largest: int) -> int:
    """The layout's P: the largest rank-local batch, or the graph's ``padded_num_tokens``
    (at least that large: vLLM's condition and message)."""
    if padded_num_tokens is None:
        return largest
    if isinstance(padded_num_tokens, (bool, np.bool_)) or not isinstance(padded_num_tokens, (int, np.integer)):
        raise ValueError(f"padded_num_tokens must be an integer, got {padded_num_tokens!r}")
    p = int(padded_num_tokens)
    if p < largest:
        # Same condition and message as vLLM's _build_batch_layout.
        raise ValueError(f"PCP padded token count is smaller than the largest rank-local batch: {p} < {largest}.")
    return p


def _check_every_token_written(hidden_restore_idx: np.ndarray, qsl: np.ndarray, dcp: int) -> None:
    """Every global token has a KV writer. Only breakable with shard_decode_requests and DCP > 1,
    a pair vLLM never configures: a short prefill is then owned by a rank that may not write it,
    and vLLM would read uninitialised memory."""
    orphans = np.flatnonzero(hidden_restore_idx < 0)
    if orphans.size:
        tok = int(orphans[0])
        req = int(np.searchsorted(qsl, tok, side="right") - 1)
        raise ValueError(
            f"global token {tok} (row {req}) has no KV writer: shard_decode_requests=True "
            f"with dcp_world_size={dcp} is not a vLLM 0.33.0 configuration "
            "(pcp_shard_decode_requests is PCP > 1 and DCP == 1)"
        )


def plan_layout(
    num_scheduled_tokens: Sequence[int] | np.ndarray,
    is_prefilling: Sequence[bool] | np.ndarray,
    pcp_world_size: int,
    *,
    shard_decode_requests: bool | None = None,
    dcp_world_size: int = 1,
    padded_num_tokens: int | None = None,
) -> PCPLayout:
    """Partition one global batch over ``pcp_world_size`` ranks, as vLLM 0.33.0 does.

    Args:
        num_scheduled_tokens: query length of each global row (zeros allowed).
        is_prefilling: per row, whether it is a prefill (fresh or continued chunk).
        pcp_world_size: N >= 1.
        shard_decode_requests: give each decode one owner rank (vLLM's default,
            ``ParallelConfig.pcp_shard_decode_requests`` = PCP > 1 and DCP == 1).
            The default ``None`` applies that rule: True unless ``dcp_world_size > 1``.
        dcp_world_size: decode context parallel size; > 1 also replicates short
            prefills.
        padded_num_tokens: the CUDA-graph token count P; must be at least the
            largest rank-local batch.

    Raises:
        ValueError: on malformed input, a ``padded_num_tokens`` that is too small
            (vLLM's message), or a combination that leaves tokens with no KV writer.
    """
    n = _check_world_size("pcp_world_size", pcp_world_size)
    dcp = _check_world_size("dcp_world_size", dcp_world_size)
    q = _as_int_array("num_scheduled_tokens", num_scheduled_tokens)
    prefill = _as_bool_array("is_prefilling", is_prefilling, q.shape[0])
    if shard_decode_requests is None:
        shard_decode_requests = n > 1 and dcp == 1
    shard = bool(shard_decode_requests)

    qsl = np.zeros(q.shape[0] + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    replicated = replicated_requests(q, prefill, n, dcp_world_size=dcp)

    segments_by_rank = rank_segments(q, prefill, qsl, replicated=replicated, n=n, shard=shard)
    per_rank = tuple(sum(s.num_tokens for s in segs) for segs in segments_by_rank)

    p = _padded_tokens(padded_num_tokens, max(per_rank))
    padded_gather_idx, hidden_restore_idx, kv_write_mask = gather_maps(
        segments_by_rank, p, int(qsl[-1]), prefill=prefill, replicated=replicated, shard=shard)
    _check_every_token_written(hidden_restore_idx, qsl, dcp)

    return PCPLayout(
        pcp_world_size=n,
        dcp_world_size=dcp,
        shard_decode_requests=shard,
        num_scheduled_tokens=q,
        is_prefilling=prefill,
        query_start_loc=qsl,
        replicated=replicated,
        segments_by_rank=segments_by_rank,
        per_rank_num_tokens=per_rank,
        padded_num_tokens=p,
        padded_gather_idx=padded_gather_idx,
        hidden_restore_idx=hidden_restore_idx,
        kv_write_mask=kv_write_mask,
    )


def _num_reqs_padded(batch: GlobalBatch, num_local_reqs: int, padded_num_reqs: int | None) -> int:
    """The local request rows including FULL-graph padding (``padded_num_reqs``: decode-only)."""
    if padded_num_reqs is None:
        return num_local_reqs
    if bool(np.any(batch.is_prefilling)):
        raise ValueError("PCP FULL graphs require a decode-only batch.")
    if padded_num_reqs < num_local_reqs:
        raise ValueError(
            "PCP graph request capacity must cover the rank-local batch: "
            f"{padded_num_reqs} < {num_local_reqs}."
        )
    return int(padded_num_reqs)


def _gather_inputs(batch: GlobalBatch, gather_idx: np.ndarray,
                   is_padding: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rank's ``input_ids`` (int32[P]) and ``positions`` (int64[P]) gathered from the global
    batch with its slice of ``padded_gather_idx``; padding rows are zero."""
    if not batch.num_tokens:
        p = gather_idx.shape[0]
        return np.zeros(p, dtype=np.int32), np.zeros(p, dtype=np.int64)
    input_ids = np.where(is_padding, 0, batch.input_ids[gather_idx]).astype(np.int32)
    positions = np.where(is_padding, 0, batch.positions[gather_idx]).astype(np.int64)
    return input_ids, positions


def _local_rows(batch: GlobalBatch, layout: PCPLayout, rank: int):
    """The rank's rows: (global row int64[L], tokens int32[L], local start int32[L], placeholder),
    the local start being the CPU cursor (an upper bound) plus the chunk offset, in vLLM's int32;
    a rank with no segment gets one zero-length placeholder row for global row 0."""
    segs = layout.segments_by_rank[rank]
    placeholder = not segs
    if placeholder:
        segs = (Segment(0, 0, 0, 0, 0),)
    n = len(segs)
    rows = np.fromiter((s.global_req_idx for s in segs), dtype=np.int64, count=n)
    lens = np.fromiter((s.num_tokens for s in segs), dtype=np.int32, count=n)
    offsets = np.fromiter((s.global_start - int(layout.query_start_loc[s.global_req_idx]) for s in segs),
                          dtype=np.int64, count=n)
    local_start = (batch.num_computed_tokens[rows].astype(np.int64) + offsets).astype(np.int32)
    return rows, lens, local_start, placeholder


def _prefilling_and_upper(batch: GlobalBatch, rows, lens, local_start, num_reqs_padded: int):
    """(is_prefilling bool[B], seq_lens_cpu_upper_bound int32[B]) of the local rows, padded to B."""
    n = rows.shape[0]
    prefill_len = batch.prefill_len[rows].astype(np.int64)
    is_prefilling = np.zeros(num_reqs_padded, dtype=np.bool_)
    is_prefilling[:n] = np.minimum(local_start, prefill_len) < prefill_len
    upper = np.zeros(num_reqs_padded, dtype=np.int32)
    upper[:n] = local_start + lens
    return is_prefilling, upper


def _starts_and_seq_lens(lens, positions, num_reqs_padded: int):
    """(query_start_loc int32[B+1], seq_lens int32[B]) of the local rows: padding rows start at
    the end and have seq_len 0; a real row's seq_len is its last local position + 1."""
    n, total = lens.shape[0], int(lens.sum())
    qsl = np.full(num_reqs_padded + 1, total, dtype=np.int32)
    qsl[0] = 0
    qsl[1 : n + 1] = np.cumsum(lens)
    seq_lens = np.zeros(num_reqs_padded, dtype=np.int32)
    if total > 0:
        seq_lens[:n] = positions[qsl[1 : n + 1] - 1] + 1
    return qsl, seq_lens


def partition_batch(
    batch: GlobalBatch,
    rank: int,
    pcp_world_size: int,
    *,
    shard_decode_requests: bool | None = None,
    dcp_world_size: int = 1,
    padded_num_tokens: int | None = None,
    padded_num_reqs: int | None = None,
    layout: PCPLayout | None = None,
) -> LocalBatch:
    """Build ``rank``'s local batch from the global batch, as ``PCPManager.partition_batch``.

    ``padded_num_tokens`` is the graph token count (PIECEWISE or FULL graphs);
    ``padded_num_reqs`` the FULL-graph request count, legal only for a
    decode-only batch. Pass ``layout`` to reuse a plan.

    What the local batch holds, and why:

    * ``input_ids``/``positions`` are gathered from the *global* tensors with the
      rank's slice of ``padded_gather_idx``; positions therefore follow the GPU
      cursor (which went back on rejection), not the optimistic CPU one.
      Padding rows are zeroed.
    * ``seq_lens[i]`` = last local position of row i + 1: a causal chunk view
      (the head chunk of a prefill sees only up to its own end).
    * ``logits_indices = query_start_loc[1:] - 1``: one per local row, never
      sampled: hidden states are restored to the global batch before sampling.
    * ``is_prefilling`` = ``min(start, prefill_len) < prefill_len`` with ``start``
      = CPU cursor + chunk offset, so a 1-token tail chunk still counts.
    * a rank with no rows gets one zero-length placeholder row for global row 0.

    Worked example: PCP=2, ``p13, d1, d4`` as in the module docstring, rank 0,
    p0 fresh and the decodes at CPU cursors 20 and 30::

        req rows         d1     p0[0:4]   p0[12:13]
        query_start_loc  [0, 1, 5, 6]        P = 12 (6 real + 6 padding)
        positions        [20, 0,1,2,3, 12, 0,0,0,0,0,0]
        seq_lens         [21, 4, 13]
        logits_indices   [0, 4, 5]
        is_prefilling    [F, T, T]
    """
    if layout is None:
        layout = plan_layout(batch.num_scheduled_tokens, batch.is_prefilling, pcp_world_size,
                             shard_decode_requests=shard_decode_requests, dcp_world_size=dcp_world_size,
                             padded_num_tokens=padded_num_tokens)
    elif layout.num_tokens != batch.num_tokens or layout.num_reqs != batch.num_reqs:
        raise ValueError("layout was planned for a different batch")
    layout.check_rank(rank)

    rows, lens, local_start, placeholder = _local_rows(batch, layout, rank)
    num_local_reqs = rows.shape[0]
    num_reqs_padded = _num_reqs_padded(batch, num_local_reqs, padded_num_reqs)
    num_local_tokens = int(lens.sum())
    p = layout.padded_num_tokens

    gather_idx = layout.local_gather_idx(rank)  # int64[P]
    is_padding = np.arange(p) >= num_local_tokens  # bool[P]
    input_ids, positions = _gather_inputs(batch, gather_idx, is_padding)

    qsl, seq_lens = _starts_and_seq_lens(lens, positions, num_reqs_padded)
    is_prefilling, upper = _prefilling_and_upper(batch, rows, lens, local_start, num_reqs_padded)
    return LocalBatch(
        rank=rank,
        req_ids=tuple(batch.req_ids[i] for i in rows.tolist()),
        global_req_idx=rows,
        idx_mapping=batch.idx_mapping[rows].astype(np.int64),
        num_scheduled_tokens=lens, num_tokens=num_local_tokens, num_tokens_padded=p,
        num_reqs=num_local_reqs, num_reqs_padded=num_reqs_padded,
        query_start_loc=qsl, input_ids=input_ids, positions=positions, seq_lens=seq_lens,
        logits_indices=(qsl[1:] - 1).astype(np.int64),
        is_prefilling=is_prefilling,
        is_padding=is_padding,
        num_computed_tokens=local_start,
        seq_lens_cpu_upper_bound=upper,
        gather_idx=gather_idx.copy(),
        global_query_lens=batch.num_scheduled_tokens[rows].astype(np.int32),
        is_placeholder=placeholder,
    )
