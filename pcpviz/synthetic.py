"""Synthetic, self-consistent PCP + MTP traces, built with the pcpviz reference.

No model runs here: token ids come from a seeded hash, and whether a draft is
"accepted" is decided by a seeded coin per (request, position, draft step). Every
*structural* view, though, is produced by the same reference code the checks
compare against — ``pcpviz.reference.layout.plan_layout`` / ``partition_batch`` for the
DualChunkSwap layout and local batch, ``pcpviz.reference.blocks`` for block tables and slot
mappings — and the step semantics follow vLLM 0.33.0 (``docs/vllm-0.33-pcp-mtp.md``):

* positions start at the GPU cursor; the CPU cursor (``num_computed_tokens``) runs
  ahead by the previous step's rejected drafts;
* a decode row is ``[last sampled token] + K drafts``; greedy-style verification
  accepts a prefix of the drafts and samples ``accepted + 1`` tokens; a partial
  prefill chunk samples nothing; the cursor advances by ``q - num_rejected``;
* ``draft_0`` runs on the rank-local rows with the target's gathered slot mapping;
  ``draft_k`` (k >= 1) is replicated: global rows, positions ``positions[last] + k``,
  an unexpanded slot mapping of length R.

Used by the tests (``tests/helpers/tracegen.py`` re-exports it) and by
``benchmarks/bench_checks.py``. ``faults=`` injects known bugs *consistently* (the
rest of the step is computed from the faulty value, as a real producer would): the faults of
``pcpviz.faults`` whose producers include ``SYNTHETIC``, each read at one switch here::

    run = generate([RequestSpec("a", 40, 6), RequestSpec("b", 9, 4)], pcp=2,
                   num_speculative_tokens=3, block_size=4, max_num_batched_tokens=24)
    run.write(tmp / "trace")            # a run directory pcpviz.trace.open() reads
    run.views(2, 1, "draft_1")          # the mutable {view: array} dict of one phase
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from pcpviz import faults as F
from pcpviz.reference.batch import GlobalBatch, scheduler_row_order
from pcpviz.reference.blocks import (
    BlockAllocator,
    BlockTable,
    compute_slot_mappings,
    draft_decode_slot_mapping,
    gather_block_table_rows,
    gathered_slot_mapping,
)
from pcpviz.reference.drafts import draft_decode_positions, draft_prefill_inputs
from pcpviz.faults import SYNTHETIC, active_faults, validate_faults
from pcpviz.reference.chunks import gather_maps, rank_segments, replicated_requests
from pcpviz.reference.layout import PCPLayout, partition_batch, plan_layout
from pcpviz.trace import TraceWriter, segments_table
from pcpviz.trace.fingerprints import synthetic_fingerprints

__all__ = ["RequestSpec", "SyntheticRun", "generate", "long_prompt_run"]

_M64 = (1 << 64) - 1


def _mix(*xs: int) -> int:
    """A 64-bit hash of a few ints (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h + (int(x) & _M64) + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h


@dataclass(frozen=True)
class RequestSpec:
    """One synthetic request: its prompt length, how many tokens to generate, and the
    first step at which the scheduler may admit it."""

    req_id: str
    prompt_len: int
    max_new_tokens: int
    arrival_step: int = 0


@dataclass
class _Req:
    spec: RequestSpec
    key: int
    prompt: np.ndarray  # int64[prompt_len]
    slot: int
    computed: int = 0  # GPU cursor
    lag: int = 0  # CPU cursor - GPU cursor (the last step's rejected drafts)
    last_token: int = -1
    drafts: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.spec.prompt_len


@dataclass
class SyntheticRun:
    """A generated run held in memory: ``meta`` (run.json) and, per step, per rank,
    ``{phase: {view: array}}``. Mutate views to build faulty traces, then ``write``."""

    meta: dict
    steps: list[tuple[int, list[dict[str, dict[str, np.ndarray]]]]]
    outputs: dict[str, list[int]]

    @property
    def step_ids(self) -> list[int]:
        return [s for s, _ in self.steps]

    @property
    def pcp(self) -> int:
        return int(self.meta["pcp"])

    def views(self, step: int, rank: int, phase: str) -> dict[str, np.ndarray]:
        """The mutable views of one phase (KeyError if absent)."""
        for s, per_rank in self.steps:
            if s == step:
                return per_rank[rank][phase]
        raise KeyError(f"no step {step}")

    def phases(self, step: int, rank: int) -> dict[str, dict[str, np.ndarray]]:
        for s, per_rank in self.steps:
            if s == step:
                return per_rank[rank]
        raise KeyError(f"no step {step}")

    def write(self, run_dir: str | os.PathLike, *, ranks: Iterable[int] | None = None) -> Path:
        """Write a run directory (run.json + rank<r>.arrow) and return its path."""
        run_dir = Path(run_dir)
        ranks = range(self.pcp) if ranks is None else list(ranks)
        for i, rank in enumerate(ranks):
            with TraceWriter(run_dir, rank, meta=self.meta if i == 0 else None) as w:
                for step, per_rank in self.steps:
                    phases = {p: v for p, v in per_rank[rank].items() if v}
                    if phases:
                        w.write_step(step, phases)
        return run_dir


def _layout_from_chunks(q: np.ndarray, prefill: np.ndarray, n: int, shard: bool, dcp: int,
                        chunk_ids, writer_rank: int = 0) -> PCPLayout:
    """A PCPLayout from an arbitrary chunk assignment ``chunk_ids(rank, N) -> chunk indices``
    for DualChunkSwap-split rows (decodes placed as vLLM does); used by layout faults."""
    qsl = np.zeros(q.shape[0] + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    replicated = replicated_requests(q, prefill, n, dcp)
    segments_by_rank = rank_segments(q, prefill, qsl, replicated=replicated, n=n, shard=shard, chunk_ids=chunk_ids)
    per_rank = tuple(sum(s.num_tokens for s in segs) for segs in segments_by_rank)
    p = max(per_rank)
    pgi, hri, mask = gather_maps(segments_by_rank, p, int(qsl[-1]), prefill=prefill, replicated=replicated,
                                 shard=shard, writer_rank=writer_rank)
    return PCPLayout(n, dcp, shard, q, prefill, qsl, replicated, segments_by_rank, per_rank,
                     p, pgi, hri, mask)


@dataclass(frozen=True)
class _Settings:
    """``generate``'s arguments, checked: N (``pcp``), K, block size, DCP and the decode placement."""

    pcp: int
    k: int
    block_size: int
    dcp: int
    shard: bool
    probs: tuple[float, ...]  # acceptance probability per draft position, float[K]
    vocab_size: int
    seed: int
    max_num_batched_tokens: int
    max_num_reqs: int
    graph_pad: int | None
    timestamps: bool
    reverse_rows: bool
    faults: frozenset[str]  # specs as given: NAME or NAME@STEP

    @property
    def dcp_kw(self) -> dict:
        """The DCP-sharded slot-mapping arguments for DCP rank 0 (empty without DCP)."""
        return dict(cp_size=self.dcp, cp_rank=0, cp_interleave=1) if self.dcp > 1 else {}

    def token(self, req: _Req, pos: int) -> int:
        """The true token at ``pos``: the prompt's, then a seeded hash."""
        if pos < req.spec.prompt_len:
            return int(req.prompt[pos])
        return _mix(self.seed, req.key, pos, 1) % self.vocab_size

    def draft(self, req: _Req, pos: int, j: int) -> int:
        """Draft position ``j``'s guess for ``pos``: the true token with probability ``probs[j]``."""
        true = self.token(req, pos)
        coin = (_mix(self.seed, req.key, pos, j, 2) >> 11) / float(1 << 53)
        return true if coin < self.probs[j] else (true + 1 + j) % self.vocab_size


def _settings(requests: Sequence[RequestSpec], *, pcp: int, num_speculative_tokens: int, block_size: int,
              dcp: int, shard_decode_requests: bool | None, accept_prob: float | Sequence[float],
              faults: Iterable[str], **rest) -> _Settings:
    faults = validate_faults(faults, producer=SYNTHETIC)
    n, k, bs = int(pcp), int(num_speculative_tokens), int(block_size)
    if n < 1 or k < 0 or bs < 1 or dcp < 1:
        raise ValueError("pcp, block_size, dcp must be >= 1 and num_speculative_tokens >= 0")
    shard = (n > 1 and dcp == 1) if shard_decode_requests is None else bool(shard_decode_requests)
    probs = [float(accept_prob)] * k if np.isscalar(accept_prob) else [float(p) for p in accept_prob]
    if len(probs) != k:
        raise ValueError(f"accept_prob needs {k} entries, got {len(probs)}")
    ids = [r.req_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    return _Settings(pcp=n, k=k, block_size=bs, dcp=dcp, shard=shard, probs=tuple(probs), faults=faults, **rest)


@dataclass
class _Step:
    """One step's global batch, rows in batch order (R rows, T tokens, K drafts)."""

    rows: list[_Req]
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
class _Verify:
    """Greedy verification, identical on every rank: ``sampled`` int64[R, K+1] (-1 past num_sampled)."""

    sampled: np.ndarray
    num_sampled: np.ndarray  # int64[R]
    num_rejected: np.ndarray  # int64[R]
    num_accepted: np.ndarray  # int64[R]
    next_prompt: np.ndarray  # int64[R] the next prompt token of a partial prefill chunk
    top1: list = field(default_factory=list)  # the target's argmax of every sampled row


@dataclass
class _Drafts:
    """The MTP step: ``last_idx`` int64[R] (draft_last_token_indices), ``global_ids`` int64[T] (the
    shifted draft-prefill ids), ``tokens`` int64[R, K], ``positions[k-1]`` int64[R] of draft_k."""

    last_idx: np.ndarray
    global_ids: np.ndarray
    tokens: np.ndarray
    positions: list[np.ndarray]


class _Simulation:
    """The scheduler, the block allocator and the request state of one ``generate`` call."""

    def __init__(self, requests: Sequence[RequestSpec], s: _Settings) -> None:
        self.s = s
        max_len = max((r.prompt_len + r.max_new_tokens for r in requests), default=1) + 2 * s.k + 2
        width = -(-max_len // (s.block_size * s.dcp)) + 1
        self.allocator = BlockAllocator(s.max_num_reqs * width + 1, s.block_size)
        self.table = BlockTable(s.max_num_reqs, width)
        self.free_slots = list(range(s.max_num_reqs - 1, -1, -1))
        self.pending = sorted([(spec, i) for i, spec in enumerate(requests)], key=lambda x: (x[0].arrival_step, x[1]))
        self.running: list[_Req] = []
        self.admitted: list[_Req] = []
        self.outputs: dict[str, list[int]] = {}
        self.clock = 0.0

    # -- scheduling
    def admit(self, step: int) -> None:
        while self.pending and self.pending[0][0].arrival_step <= step and self.free_slots:
            spec, key = self.pending.pop(0)
            rng = np.random.default_rng([self.s.seed, key])
            req = _Req(spec, key, rng.integers(0, self.s.vocab_size, spec.prompt_len), self.free_slots.pop())
            self.running.append(req)
            self.admitted.append(req)

    def schedule(self) -> list[tuple[_Req, int]]:
        """Decodes first, then prefill chunks, within the token budget: ``[(request, q)]``."""
        budget = self.s.max_num_batched_tokens
        picked: list[tuple[_Req, int]] = []
        for req in self.running:
            if not req.prefilling:
                ql = 1 + len(req.drafts)
                if ql <= budget:
                    picked.append((req, ql))
                    budget -= ql
        for req in self.running:
            if req.prefilling and budget > 0:
                ql = min(req.spec.prompt_len - req.computed, budget)
                picked.append((req, ql))
                budget -= ql
        return picked

    def allocate(self, picked: list[tuple[_Req, int]], on: frozenset[str]) -> np.ndarray:
        """KV blocks for the target positions plus the draft decodes' lookahead, in scheduling order
        (so the row order does not change block ids); the persistent table int32[max_num_reqs, W]."""
        s, lag_on = self.s, F.GLOBAL_POSITIONS_FROM_CPU_CURSOR in on
        for r, ql in picked:
            start = r.computed + (r.lag if lag_on else 0)
            need = -(-(int(start) + int(ql) + s.k + 1) // (s.block_size * s.dcp)) - self.table.num_blocks(r.slot)
            if need > 0:
                self.table.append(r.slot, self.allocator.allocate(need))
        full = self.table.as_array()
        if F.SHARED_KV_BLOCK in on and len(self.admitted) >= 2:
            a, b = self.admitted[0], self.admitted[1]
            if self.table.num_blocks(a.slot) and self.table.num_blocks(b.slot):
                full[b.slot, 0] = full[a.slot, 0]
        if F.NULL_BLOCK_WRITE in on:
            r0, _ = picked[0]
            start0 = r0.computed + (r0.lag if lag_on else 0)
            full[r0.slot, start0 // (s.block_size * s.dcp)] = 0
        return full

    # -- request state
    def advance(self, st: _Step, v: _Verify, d: _Drafts) -> None:
        valid = st.q - v.num_rejected
        for i, r in enumerate(st.rows):
            r.computed += int(valid[i])
            r.lag = int(v.num_rejected[i])
            if v.num_sampled[i] > 0:
                r.last_token = int(v.sampled[i, v.num_sampled[i] - 1])
                r.output += [int(x) for x in v.sampled[i, :v.num_sampled[i]]]
                r.drafts = [int(x) for x in d.tokens[i]]
            if len(r.output) >= r.spec.max_new_tokens:
                self.outputs[r.spec.req_id] = r.output[:r.spec.max_new_tokens]
                self.running.remove(r)
                self.allocator.free(self.table.clear(r.slot))
                self.free_slots.append(r.slot)


def _global_step(picked: list[tuple[_Req, int]], s: _Settings, on: frozenset[str]) -> _Step:
    """The global batch in vLLM's row order (decodes with drafts first): positions from the GPU
    cursor, a decode row ``[last sampled token] + drafts``."""
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
    return _Step(rq, q, qsl, positions, input_ids, np.array([r.prefilling for r in rq], dtype=np.bool_),
                 np.array([0 if r.prefilling else len(r.drafts) for r in rq], dtype=np.int64))


def _finish_batch(st: _Step) -> None:
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


def _step_layout(st: _Step, s: _Settings, on: frozenset[str]) -> PCPLayout:
    """vLLM's DualChunkSwap layout (P rounded up to ``graph_pad``), or a layout fault's."""
    n, q, pre = s.pcp, st.q, st.prefilling
    if F.LAYOUT_NO_SWAP in on:
        return _layout_from_chunks(q, pre, n, s.shard, s.dcp, lambda r_, n_: (2 * r_, 2 * r_ + 1))
    if F.REPLICATED_WRITER_NOT_RANK0 in on:
        return _layout_from_chunks(q, pre, n, s.shard, s.dcp, lambda r_, n_: (r_, 2 * n_ - 1 - r_), writer_rank=n - 1)
    largest = max(plan_layout(q, pre, n, shard_decode_requests=s.shard, dcp_world_size=s.dcp).per_rank_num_tokens)
    p = None if s.graph_pad is None else -(-largest // s.graph_pad) * s.graph_pad
    return plan_layout(q, pre, n, shard_decode_requests=s.shard, dcp_world_size=s.dcp, padded_num_tokens=p)


def _slots(st: _Step, layout: PCPLayout, full: np.ndarray, s: _Settings) -> None:
    """The step's global and gathered slot mappings and the global block-table rows."""
    idx = st.batch.idx_mapping
    st.slot_mapping_global = compute_slot_mappings(full, s.block_size, idx, st.qsl, st.positions, **s.dcp_kw)
    st.slot_mapping_gathered = gathered_slot_mapping(st.slot_mapping_global, layout)
    st.block_table_global = gather_block_table_rows(full, idx)[None]


def _verify(st: _Step, s: _Settings) -> _Verify:
    """Greedy verification: a decode accepts its drafts' longest correct prefix and samples
    ``accepted + 1`` tokens; a prefill's last chunk samples one; a partial chunk none."""
    num_r, k = len(st.rows), s.k
    v = _Verify(np.full((num_r, k + 1), -1, dtype=np.int64), *(np.zeros(num_r, dtype=np.int64) for _ in range(4)))
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


def _drafts(st: _Step, v: _Verify, s: _Settings, on: frozenset[str]) -> _Drafts:
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
    return _Drafts(last_idx, dgi, tokens, draft_pos)


def _positions_from_cpu_cursor(local, lqsl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """POSITIONS_FROM_CPU_CURSOR: local positions and seq_lens rebuilt from the CPU cursor."""
    lens = np.diff(lqsl)
    lpos = np.zeros_like(local.positions)
    lpos[:local.num_tokens] = (np.repeat(local.num_computed_tokens.astype(np.int64), lens)
                               + np.arange(local.num_tokens) - np.repeat(lqsl[:-1], lens))
    lsl = np.where(lens > 0, lpos[np.maximum(lqsl[1:] - 1, 0)] + 1, 0)
    return lpos, lsl


def _rank_phases(rank: int, st: _Step, layout: PCPLayout, full: np.ndarray, v: _Verify, d: _Drafts,
                 s: _Settings, on: frozenset[str]) -> dict[str, dict[str, np.ndarray]]:
    """Every phase one rank records for the step: target, draft_0 (rank-local), draft_k (replicated), verify."""
    batch, qsl, k = st.batch, st.qsl, s.k
    idx_mapping = batch.idx_mapping
    slots_global, slots_gathered, bt_global = st.slot_mapping_global, st.slot_mapping_gathered, st.block_table_global
    local = partition_batch(batch, rank, s.pcp, layout=layout)
    r_loc = local.num_reqs
    bt_local = gather_block_table_rows(full, local.idx_mapping, local.num_reqs_padded)[None]
    lqsl = local.query_start_loc[:r_loc + 1].astype(np.int64)
    lpos, lsl = local.positions, local.seq_lens[:r_loc].astype(np.int64)
    if F.POSITIONS_FROM_CPU_CURSOR in on:
        lpos, lsl = _positions_from_cpu_cursor(local, lqsl)
    local_sampled = F.SAMPLE_LOCAL_LOGITS in on
    target = {
        "req_ids": np.array(batch.req_ids, dtype=str), "idx_mapping": idx_mapping,
        "num_scheduled_tokens": st.q, "num_computed_tokens": batch.num_computed_tokens.astype(np.int64),
        "query_start_loc": qsl, "positions": st.positions, "input_ids": st.input_ids, "seq_lens": st.seq_lens,
        "is_prefilling": st.prefilling, "logits_indices": st.logits_indices,
        "segments": segments_table(layout.segments_by_rank),
        "per_rank_num_tokens": np.array(layout.per_rank_num_tokens, dtype=np.int64),
        "padded_gather_idx": layout.padded_gather_idx, "hidden_restore_idx": layout.hidden_restore_idx,
        "kv_write_mask": layout.kv_write_mask,
        "local_req_ids": np.array(local.req_ids, dtype=str), "local_input_ids": local.input_ids.astype(np.int64),
        "local_positions": lpos, "local_query_start_loc": lqsl, "local_seq_lens": lsl,
        "local_logits_indices": local.logits_indices[:r_loc], "local_is_padding": local.is_padding,
        "local_is_prefilling": local.is_prefilling[:r_loc],
        "block_table_global": bt_global, "block_table_local": bt_local[:, :r_loc],
        "slot_mapping_global": slots_global, "slot_mapping_gathered": slots_gathered,
        "sampled_logits_rows": local.logits_indices[:r_loc] if local_sampled else st.logits_indices,
        "sampled_from": np.array("local" if local_sampled else "global"),
    }
    phases = {"target": target}
    if k > 0:
        phases["draft_0"] = {
            "view": np.array("rank_local"), "draft_input_ids": d.global_ids[local.gather_idx],
            "draft_positions": lpos, "draft_seq_lens": lsl, "block_table_draft": bt_local[:, :r_loc],
            "slot_mapping_draft": slots_gathered, "draft_last_token_indices": d.last_idx,
            "draft_tokens": d.tokens[:, 0], "draft_global_input_ids": d.global_ids,
        }
    for j in range(1, k):
        pj = d.positions[j - 1]
        slots = draft_decode_slot_mapping(full, s.block_size, idx_mapping, positions=pj, **s.dcp_kw)
        phases[f"draft_{j}"] = {
            "view": np.array("replicated"), "draft_input_ids": d.tokens[:, j - 1], "draft_positions": pj,
            "draft_seq_lens": pj + 1,
            "block_table_draft": np.zeros_like(bt_global) if F.SKIP_DRAFT_BLOCK_TABLE_GATHER in on else bt_global,
            "slot_mapping_draft": slots_gathered if F.EXPANDED_DRAFT_SLOT_MAPPING in on else slots,
            "draft_tokens": d.tokens[:, j],
        }
    synthetic_fingerprints(phases, rank, layout, positions=st.positions, input_ids=st.input_ids, n=s.pcp,
                           global_ids=d.global_ids, last_idx=d.last_idx)
    target["top1_token"] = np.asarray(v.top1, dtype=np.int64)
    phases["verify"] = {
        "req_ids": np.array(batch.req_ids, dtype=str), "num_draft_tokens": st.num_draft,
        "sampled_token_ids": v.sampled, "num_sampled": v.num_sampled, "num_rejected": v.num_rejected,
        "num_accepted": v.num_accepted,
    }
    return phases


def _add_timestamps(phases: dict[str, dict[str, np.ndarray]], t0: float, layout: PCPLayout, num_r: int) -> float:
    """``t_start_us`` / ``t_end_us`` (int64 µs, as declared) for each phase from ``t0`` on; the end."""
    tt = t0
    for phase, views in phases.items():
        dur = 20.0 + 0.05 * layout.padded_num_tokens if phase in ("target", "draft_0") else 5.0 + 0.1 * num_r
        views["t_start_us"] = np.array(round(tt), dtype=np.int64)
        views["t_end_us"] = np.array(round(tt + dur), dtype=np.int64)
        tt += dur + 1.0
    return tt


def generate(
    requests: Sequence[RequestSpec],
    *,
    pcp: int = 2,
    num_speculative_tokens: int = 2,
    block_size: int = 4,
    max_num_batched_tokens: int = 32,
    max_num_reqs: int = 16,
    shard_decode_requests: bool | None = None,
    dcp: int = 1,
    accept_prob: float | Sequence[float] = 0.7,
    vocab_size: int = 1000,
    seed: int = 0,
    graph_pad: int | None = None,
    timestamps: bool = False,
    reverse_rows: bool = False,
    faults: Iterable[str] = (),
    producer: str = "pcpviz-synthetic",
    max_steps: int = 10_000,
) -> SyntheticRun:
    """Simulate the requests to completion and record every step on every rank.

    ``dcp > 1`` makes decodes replicated (rank 0's copy kept in the gathered mapping) and uses DCP-sharded
    slot mappings for DCP rank 0, as vLLM does; ``shard_decode_requests`` overrides the
    decode placement (default: vLLM's rule, sharded iff PCP > 1 and DCP == 1).
    ``graph_pad`` rounds P up to a multiple (a CUDA-graph size). ``reverse_rows`` reverses the
    global row order (a producer that orders rows differently; results are unchanged).
    ``faults``: names (or ``NAME@STEP``) from ``pcpviz.faults.faults_of(SYNTHETIC)``.
    """
    s = _settings(requests, pcp=pcp, num_speculative_tokens=num_speculative_tokens, block_size=block_size,
                  dcp=dcp, shard_decode_requests=shard_decode_requests, accept_prob=accept_prob,
                  faults=faults, vocab_size=vocab_size, seed=seed, max_num_batched_tokens=max_num_batched_tokens,
                  max_num_reqs=max_num_reqs, graph_pad=graph_pad, timestamps=timestamps, reverse_rows=reverse_rows)
    sim = _Simulation(requests, s)
    steps: list[tuple[int, list[dict]]] = []
    step = 0
    while sim.pending or sim.running:
        if step >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps")
        sim.admit(step)
        picked = sim.schedule()
        if picked:
            on = active_faults(s.faults, step, producer=SYNTHETIC)
            st = _global_step(picked, s, on)
            full = sim.allocate(picked, on)
            _finish_batch(st)
            layout = _step_layout(st, s, on)
            _slots(st, layout, full, s)
            v = _verify(st, s)
            d = _drafts(st, v, s, on)
            per_rank = []
            step_t0 = sim.clock
            for rank in range(s.pcp):
                phases = _rank_phases(rank, st, layout, full, v, d, s, on)
                if s.timestamps:
                    end = _add_timestamps(phases, step_t0 + 3.0 * rank, layout, len(st.rows))
                    sim.clock = max(sim.clock, end + 10.0)
                per_rank.append(phases)
            steps.append((step, per_rank))
            sim.advance(st, v, d)
        step += 1

    meta = {
        "producer": producer, "pcp": s.pcp, "dcp": dcp, "dcp_rank": 0,
        "num_speculative_tokens": s.k, "block_size": s.block_size, "shard_decode_requests": s.shard,
        "model": "synthetic", "seed": seed, "max_num_batched_tokens": max_num_batched_tokens,
        "inject": sorted(s.faults), "num_requests": len(requests),
    }
    return SyntheticRun(meta, steps, sim.outputs)


def long_prompt_run(*, pcp: int = 4, prompt_len: int = 32_768, chunk: int = 8192,
                    num_short: int = 7, max_new_tokens: int = 96, num_speculative_tokens: int = 3,
                    block_size: int = 16, seed: int = 0) -> SyntheticRun:
    """The benchmark scenario: one long prompt chunked over a few steps next to short requests,
    then tens of decode steps (PCP=4, K=3 by default)."""
    reqs = [RequestSpec("long", prompt_len, max_new_tokens, 0)]
    reqs += [RequestSpec(f"s{i}", 200 + 150 * i, max_new_tokens // 2 + 4 * i, i % 3)
             for i in range(num_short)]
    return generate(reqs, pcp=pcp, num_speculative_tokens=num_speculative_tokens,
                    block_size=block_size, max_num_batched_tokens=chunk,
                    max_num_reqs=len(reqs) + 1, seed=seed, accept_prob=0.6)
