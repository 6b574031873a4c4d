"""One step of a synthetic run on the global batch, identical on every rank: the batch in
vLLM's row order, its DualChunkSwap layout, its slot mappings, the verification and the MTP
drafter's inputs and drafts, each computed by the pcpviz reference (a fault, where one is on,
changes its value and everything computed from it).

PCP=2, K=2: a decode ``d`` carrying 2 drafts and a 6-token prefill chunk ``p``: rows ``[d, p]``
(decodes with drafts first), T = 3 + 6 tokens, positions from the GPU cursor; ``verify``
accepts d's drafts' longest correct prefix; ``draft_step`` gives draft_1 the position after
the last accepted row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pcpviz import faults as F
from pcpviz.reference.batch import GlobalBatch, scheduler_row_order
from pcpviz.reference.blocks import compute_slot_mappings, gather_block_table_rows, gathered_slot_mapping
from pcpviz.reference.chunks import gather_maps, rank_segments, replicated_requests
from pcpviz.reference.drafts import draft_decode_positions, draft_prefill_inputs
from pcpviz.reference.layout import PCPLayout, plan_layout
from pcpviz.synthetic.settings import Req, Settings

__all__ = ["Step", "Verify", "Drafts", "global_step", "step_layout", "step_slots", "verify", "draft_step"]


@dataclass
class Step:
    """One step's global batch, rows in batch order (R rows, T tokens, K drafts)."""

    rows: list[Req]
    q: np.ndarray  # int64[R] scheduled tokens
    qsl: np.ndarray  # int64[R+1]
    positions: np.ndarray  # int64[T]
    input_ids: np.ndarray  # int64[T]
    prefilling: np.ndarray  # bool[R]
    num_draft: np.ndarray  # int64[R]
    batch: GlobalBatch | None = None
    seq_lens: np.ndarray | None = None  # int64[R]
    logits_indices: np.ndarray | None = None  # int64[R + sum(num_draft)]
    slot_mapping_global: np.ndarray | None = None  # int64[G, T]
    slot_mapping_gathered: np.ndarray | None = None  # int64[G, N*P], PAD = -1
    block_table_global: np.ndarray | None = None  # int32[1, R, W]


@dataclass
class Verify:
    """Greedy verification, identical on every rank: ``sampled`` int64[R, K+1] (-1 past num_sampled)."""

    sampled: np.ndarray
    num_sampled: np.ndarray  # int64[R]
    num_rejected: np.ndarray  # int64[R]
    num_accepted: np.ndarray  # int64[R]
    next_prompt: np.ndarray  # int64[R] the next prompt token of a partial prefill chunk
    top1: list = field(default_factory=list)  # the target's argmax of every sampled row


@dataclass
class Drafts:
    """The MTP step: ``last_idx`` int64[R] (draft_last_token_indices), ``global_ids`` int64[T] (the
    shifted draft-prefill ids), ``tokens`` int64[R, K], ``positions[k-1]`` int64[R] of draft_k."""

    last_idx: np.ndarray
    global_ids: np.ndarray
    tokens: np.ndarray
    positions: list[np.ndarray]


def global_step(picked: list[tuple[Req, int]], s: Settings, on: frozenset[str]) -> Step:
    """The global batch in vLLM's row order (decodes with drafts first): positions from the GPU
    cursor, a decode row ``[last sampled token] + drafts``; its GlobalBatch, seq_lens and
    logits_indices."""
    order = scheduler_row_order([ql for _, ql in picked],
                                [not r.prefilling and len(r.drafts) > 0 for r, _ in picked], 1 + s.k)
    if s.reverse_rows:
        order = order[::-1]
    rows = [picked[i] for i in order]
    q = np.array([ql for _, ql in rows], dtype=np.int64)
    qsl = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    lag_on = F.GLOBAL_POSITIONS_FROM_CPU_CURSOR in on
    starts = np.array([r.computed + (r.lag if lag_on else 0) for r, _ in rows], dtype=np.int64)
    positions = np.concatenate([np.arange(st, st + ql) for st, ql in zip(starts, q)])
    input_ids = np.concatenate([
        r.prompt[r.computed:r.computed + ql] if r.prefilling else np.array([r.last_token] + r.drafts, dtype=np.int64)
        for r, ql in rows
    ]).astype(np.int64)
    rq = [r for r, _ in rows]
    st = Step(rq, q, qsl, positions, input_ids, np.array([r.prefilling for r in rq], dtype=np.bool_),
              np.array([0 if r.prefilling else len(r.drafts) for r in rq], dtype=np.int64))
    _finish_batch(st)
    return st


def _finish_batch(st: Step) -> None:
    """The GlobalBatch record, seq_lens and logits_indices of a step."""
    rq = st.rows
    st.batch = GlobalBatch(
        req_ids=tuple(r.spec.req_id for r in rq), idx_mapping=np.array([r.slot for r in rq], dtype=np.int64),
        num_scheduled_tokens=st.q, num_computed_tokens=np.array([r.computed + r.lag for r in rq]),
        positions=st.positions, input_ids=st.input_ids,
        prefill_len=np.array([r.spec.prompt_len for r in rq], dtype=np.int64), is_prefilling=st.prefilling,
    )
    st.seq_lens = st.positions[st.qsl[1:] - 1] + 1
    st.logits_indices = np.concatenate(
        [np.arange(st.qsl[i + 1] - 1 - st.num_draft[i], st.qsl[i + 1]) for i in range(len(rq))]
    ).astype(np.int64)


def step_layout(st: Step, s: Settings, on: frozenset[str]) -> PCPLayout:
    """vLLM's DualChunkSwap layout (P rounded up to ``graph_pad``), or a layout fault's."""
    n, q, pre = s.pcp, st.q, st.prefilling
    if F.LAYOUT_NO_SWAP in on:
        return _layout_from_chunks(q, pre, n, s.shard, s.dcp, lambda r_, n_: (2 * r_, 2 * r_ + 1))
    if F.REPLICATED_WRITER_NOT_RANK0 in on:
        return _layout_from_chunks(q, pre, n, s.shard, s.dcp, lambda r_, n_: (r_, 2 * n_ - 1 - r_), writer_rank=n - 1)
    largest = max(plan_layout(q, pre, n, shard_decode_requests=s.shard, dcp_world_size=s.dcp).per_rank_num_tokens)
    p = None if s.graph_pad is None else -(-largest // s.graph_pad) * s.graph_pad
    return plan_layout(q, pre, n, shard_decode_requests=s.shard, dcp_world_size=s.dcp, padded_num_tokens=p)


def step_slots(st: Step, layout: PCPLayout, *, full: np.ndarray, s: Settings) -> None:
    """The step's global and gathered slot mappings and the global block-table rows."""
    idx = st.batch.idx_mapping
    st.slot_mapping_global = compute_slot_mappings(full, s.block_size, idx, query_start_loc=st.qsl,
                                                   positions=st.positions, **s.dcp_kw)
    st.slot_mapping_gathered = gathered_slot_mapping(st.slot_mapping_global, layout)
    st.block_table_global = gather_block_table_rows(full, idx)[None]


def verify(st: Step, s: Settings) -> Verify:
    """Greedy verification: a decode accepts its drafts' longest correct prefix and samples
    ``accepted + 1`` tokens; a prefill's last chunk samples one; a partial chunk none."""
    num_r, k = len(st.rows), s.k
    v = Verify(np.full((num_r, k + 1), -1, dtype=np.int64), *(np.zeros(num_r, dtype=np.int64) for _ in range(4)))
    for i, r in enumerate(st.rows):
        c, ql, d = r.computed, int(st.q[i]), int(st.num_draft[i])
        v.top1 += [s.token(r, c + ql)] if r.prefilling else [s.token(r, c + 1 + j) for j in range(d + 1)]
        if r.prefilling:
            if c + ql == r.spec.prompt_len:
                v.sampled[i, 0] = s.token(r, c + ql)
                v.num_sampled[i] = 1
            else:
                v.next_prompt[i] = s.token(r, c + ql)
            continue
        a = 0
        while a < d and r.drafts[a] == s.token(r, c + 1 + a):
            a += 1
        v.sampled[i, :a + 1] = [s.token(r, c + 1 + j) for j in range(a + 1)]
        v.num_sampled[i], v.num_accepted[i], v.num_rejected[i] = a + 1, a, d - a
    return v


def draft_step(st: Step, v: Verify, s: Settings, *, on: frozenset[str]) -> Drafts:
    """The MTP draft-prefill inputs (global shifted ids, the last accepted rows) and the K drafts."""
    num_r, qsl, k = len(st.rows), st.qsl, s.k
    valid = st.q - v.num_rejected
    dgi, last_idx = draft_prefill_inputs(st.input_ids, qsl, num_rejected=v.num_rejected, num_sampled=v.num_sampled,
                                         last_sampled=v.sampled[np.arange(num_r), np.maximum(v.num_sampled - 1, 0)],
                                         next_prompt_tokens=v.next_prompt)
    last_idx = qsl[:-1] + st.q - 1 if F.LAST_TOKEN_IGNORES_REJECTIONS in on else last_idx
    tokens = np.zeros((num_r, k), dtype=np.int64)
    for i, r in enumerate(st.rows):
        nxt = r.computed + int(valid[i])  # next step's first position (L)
        for j in range(k):
            tokens[i, j] = s.draft(r, nxt + 1 + j, j)
    lag = 1 if F.DRAFT_POSITIONS_NOT_ADVANCED in on else 0  # the fault: draft_k (k >= 2) keeps draft_1's position
    draft_pos = [p - lag * j for j, p in enumerate(draft_decode_positions(st.positions, last_idx, k))]
    return Drafts(last_idx, dgi, tokens, draft_pos)


def _layout_from_chunks(q: np.ndarray, prefill: np.ndarray, n: int, shard: bool, dcp: int,
                        chunk_ids, writer_rank: int = 0) -> PCPLayout:
    """A PCPLayout from an arbitrary chunk assignment ``chunk_ids(rank, N) -> chunk indices``
    for DualChunkSwap-split rows (decodes placed as vLLM does); used by layout faults."""
    qsl = np.zeros(q.shape[0] + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    replicated = replicated_requests(q, prefill, n, dcp_world_size=dcp)
    segments_by_rank = rank_segments(q, prefill, qsl, replicated=replicated, n=n, shard=shard, chunk_ids=chunk_ids)
    per_rank = tuple(sum(s.num_tokens for s in segs) for segs in segments_by_rank)
    p = max(per_rank)
    pgi, hri, mask = gather_maps(segments_by_rank, p, int(qsl[-1]), prefill=prefill, replicated=replicated,
                                 shard=shard, writer_rank=writer_rank)
    return PCPLayout(n, dcp, shard, q, prefill, qsl, replicated, segments_by_rank, per_rank,
                     p, pgi, hri, mask)
