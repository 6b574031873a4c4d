"""Synthetic, self-consistent PCP + MTP traces, built with the pcpviz reference.

No model runs here: token ids come from a seeded hash, and whether a draft is
"accepted" is decided by a seeded coin per (request, position, draft step). Every
*structural* view, though, is produced by the same reference code the checks
compare against — ``pcpviz.layout.plan_layout`` / ``partition_batch`` for the
DualChunkSwap layout and local batch, ``pcpviz.blocks`` for block tables and slot
mappings — and the step semantics follow vLLM 0.33.0 (``docs/vllm-0.33-pcp-mtp.md``):

* positions start at the GPU cursor; the CPU cursor (``num_computed_tokens``) runs
  ahead by the previous step's rejected drafts;
* a decode row is ``[last sampled token] + K drafts``; greedy-style verification
  accepts a prefix of the drafts and samples ``accepted + 1`` tokens; a partial
  prefill chunk samples nothing; the cursor advances by ``q - num_rejected``;
* ``draft_0`` runs on the rank-local rows with the target's gathered slot mapping;
  ``draft_k`` (k >= 1) is replicated: global rows, positions ``positions[last] + k``,
  an unexpanded slot mapping of length R.

Used by the tests (``tests/tracegen.py`` re-exports it) and by
``benchmarks/bench_checks.py``. ``faults=`` injects known bugs *consistently* (the
rest of the step is computed from the faulty value, as a real producer would)::

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

from pcpviz.batch import GlobalBatch, scheduler_row_order
from pcpviz.blocks import (
    BlockAllocator,
    BlockTable,
    compute_slot_mappings,
    draft_decode_slot_mapping,
    gather_block_table_rows,
    gathered_slot_mapping,
)
from pcpviz.layout import (PCPLayout, gather_maps, partition_batch, plan_layout, rank_segments,
                           replicated_requests)
from pcpviz.trace import TraceWriter, segments_table

__all__ = ["RequestSpec", "SyntheticRun", "generate", "FAULTS", "long_prompt_run"]

FAULTS: dict[str, str] = {
    "global_positions_from_cpu_cursor": "global positions start at the CPU cursor (an upper bound "
                                        "after a rejection) instead of the GPU cursor",
    "local_positions_from_cpu_cursor": "local positions (and local seq_lens) are rebuilt from the "
                                       "CPU cursor instead of gathered from the global positions "
                                       "(the engine's positions_from_cpu_cursor)",
    "skip_draft_block_table_gather": "draft decodes (k >= 1) read stale all-zero block tables "
                                     "instead of the global rows (the slot mapping stays right: it "
                                     "indexes the persistent table by request slot)",
    "expanded_draft_slot_mapping": "draft decodes (k >= 1) record/write the target's expanded "
                                   "gathered slot mapping ([G, N*P]) instead of their own [G, R]",
    "draft_positions_not_advanced": "draft decode k >= 2 reuses draft k-1's positions",
    "last_token_ignores_rejections": "draft_last_token_indices = qsl + q - 1 (rejected rows "
                                     "included); draft positions follow the wrong rows",
    "sample_local_logits": "sampling reads local rows (records the rank-local logits indices)",
    "shared_kv_block": "the allocator hands the first two requests the same first KV block",
    "layout_no_swap": "prefills are split into contiguous chunks (2r, 2r+1) instead of the "
                      "DualChunkSwap pair (r, 2N-1-r)",
    "replicated_writer_not_rank0": "replicated (non-sharded) rows are written by the last rank "
                                   "instead of rank 0",
    "null_block_write": "the first row's block at its first scheduled position is missing from "
                        "the table (0, the null block), so its KV is written into block 0",
}

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
    segments_by_rank = rank_segments(q, prefill, qsl, replicated, n, shard, chunk_ids)
    per_rank = tuple(sum(s.num_tokens for s in segs) for segs in segments_by_rank)
    p = max(per_rank)
    pgi, hri, mask = gather_maps(segments_by_rank, p, int(qsl[-1]), prefill, replicated, shard,
                                 writer_rank)
    return PCPLayout(n, dcp, shard, q, prefill, qsl, replicated, segments_by_rank, per_rank,
                     p, pgi, hri, mask)


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
    """
    faults = frozenset(faults)
    unknown = sorted(faults - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; known: {', '.join(sorted(FAULTS))}")
    n, k, bs = int(pcp), int(num_speculative_tokens), int(block_size)
    if n < 1 or k < 0 or bs < 1 or dcp < 1:
        raise ValueError("pcp, block_size, dcp must be >= 1 and num_speculative_tokens >= 0")
    shard = (n > 1 and dcp == 1) if shard_decode_requests is None else bool(shard_decode_requests)
    probs = [float(accept_prob)] * k if np.isscalar(accept_prob) else [float(p) for p in accept_prob]
    if len(probs) != k:
        raise ValueError(f"accept_prob needs {k} entries, got {len(probs)}")
    dcp_kw = dict(cp_size=dcp, cp_rank=0, cp_interleave=1) if dcp > 1 else {}
    ids = [r.req_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")

    max_len = max((r.prompt_len + r.max_new_tokens for r in requests), default=1) + 2 * k + 2
    width = -(-max_len // (bs * dcp)) + 1
    allocator = BlockAllocator(max_num_reqs * width + 1, bs)
    table = BlockTable(max_num_reqs, width)
    free_slots = list(range(max_num_reqs - 1, -1, -1))

    def tok(req: _Req, pos: int) -> int:
        if pos < req.spec.prompt_len:
            return int(req.prompt[pos])
        return _mix(seed, req.key, pos, 1) % vocab_size

    def draft_for(req: _Req, pos: int, j: int) -> int:
        true = tok(req, pos)
        coin = (_mix(seed, req.key, pos, j, 2) >> 11) / float(1 << 53)
        return true if coin < probs[j] else (true + 1 + j) % vocab_size

    pending = sorted(
        [(spec, i) for i, spec in enumerate(requests)], key=lambda x: (x[0].arrival_step, x[1])
    )
    running: list[_Req] = []
    admitted: list[_Req] = []
    outputs: dict[str, list[int]] = {}
    steps: list[tuple[int, list[dict]]] = []
    clock = 0.0
    step = 0
    while pending or running:
        if step >= max_steps:
            raise RuntimeError(f"simulation did not finish in {max_steps} steps")
        while pending and pending[0][0].arrival_step <= step and free_slots:
            spec, key = pending.pop(0)
            rng = np.random.default_rng([seed, key])
            req = _Req(spec, key, rng.integers(0, vocab_size, spec.prompt_len), free_slots.pop())
            running.append(req)
            admitted.append(req)
        # -- schedule: decodes first, then prefill chunks, within the token budget
        budget = max_num_batched_tokens
        picked: list[tuple[_Req, int]] = []
        for req in running:
            if not req.prefilling:
                ql = 1 + len(req.drafts)
                if ql <= budget:
                    picked.append((req, ql))
                    budget -= ql
        for req in running:
            if req.prefilling and budget > 0:
                ql = min(req.spec.prompt_len - req.computed, budget)
                picked.append((req, ql))
                budget -= ql
        if not picked:
            step += 1
            continue
        order = scheduler_row_order([ql for _, ql in picked],
                                    [not r.prefilling and len(r.drafts) > 0 for r, _ in picked], 1 + k)
        if reverse_rows:
            order = order[::-1]
        rows = [picked[i] for i in order]
        rq = [r for r, _ in rows]
        q = np.array([ql for _, ql in rows], dtype=np.int64)
        num_r = len(rows)
        qsl = np.zeros(num_r + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        lag_on = "global_positions_from_cpu_cursor" in faults
        starts = np.array([r.computed + (r.lag if lag_on else 0) for r in rq], dtype=np.int64)
        positions = np.concatenate([np.arange(s, s + ql) for s, ql in zip(starts, q)])
        input_ids = np.concatenate([
            r.prompt[r.computed:r.computed + ql] if r.prefilling
            else np.array([r.last_token] + r.drafts, dtype=np.int64)
            for r, ql in rows
        ]).astype(np.int64)
        prefilling = np.array([r.prefilling for r in rq], dtype=np.bool_)
        num_draft = np.array([0 if r.prefilling else len(r.drafts) for r in rq], dtype=np.int64)
        # -- KV blocks (in scheduling order, so the row order does not change block ids):
        # target positions plus the draft decodes' lookahead
        for r, ql in picked:
            s = r.computed + (r.lag if lag_on else 0)
            need = -(-(int(s) + int(ql) + k + 1) // (bs * dcp)) - table.num_blocks(r.slot)
            if need > 0:
                table.append(r.slot, allocator.allocate(need))
        full = table.as_array()  # int32[max_num_reqs, W]
        if "shared_kv_block" in faults and len(admitted) >= 2:
            a, b = admitted[0], admitted[1]
            if table.num_blocks(a.slot) and table.num_blocks(b.slot):
                full[b.slot, 0] = full[a.slot, 0]
        if "null_block_write" in faults:
            r0, _ = picked[0]
            start0 = r0.computed + (r0.lag if lag_on else 0)
            full[r0.slot, start0 // (bs * dcp)] = 0
        idx_mapping = np.array([r.slot for r in rq], dtype=np.int64)
        batch = GlobalBatch(
            req_ids=tuple(r.spec.req_id for r in rq), idx_mapping=idx_mapping,
            num_scheduled_tokens=q, num_computed_tokens=np.array([r.computed + r.lag for r in rq]),
            positions=positions, input_ids=input_ids,
            prefill_len=np.array([r.spec.prompt_len for r in rq], dtype=np.int64),
            is_prefilling=prefilling,
        )
        seq_lens = positions[qsl[1:] - 1] + 1
        logits_indices = np.concatenate(
            [np.arange(qsl[i + 1] - 1 - num_draft[i], qsl[i + 1]) for i in range(num_r)]
        ).astype(np.int64)

        # -- layout
        if "layout_no_swap" in faults:
            layout = _layout_from_chunks(q, prefilling, n, shard, dcp, lambda r_, n_: (2 * r_, 2 * r_ + 1))
        elif "replicated_writer_not_rank0" in faults:
            layout = _layout_from_chunks(q, prefilling, n, shard, dcp, lambda r_, n_: (r_, 2 * n_ - 1 - r_),
                                         writer_rank=n - 1)
        else:
            largest = max(plan_layout(q, prefilling, n, shard_decode_requests=shard,
                                      dcp_world_size=dcp).per_rank_num_tokens)
            p = None if graph_pad is None else -(-largest // graph_pad) * graph_pad
            layout = plan_layout(q, prefilling, n, shard_decode_requests=shard, dcp_world_size=dcp,
                                 padded_num_tokens=p)
        slots_global = compute_slot_mappings(full, bs, idx_mapping, qsl, positions, **dcp_kw)
        slots_gathered = gathered_slot_mapping(slots_global, layout)
        bt_global = gather_block_table_rows(full, idx_mapping)[None]  # int32[1, R, W]

        # -- verify (identical on every rank)
        sampled = np.full((num_r, k + 1), -1, dtype=np.int64)
        num_sampled = np.zeros(num_r, dtype=np.int64)
        num_rejected = np.zeros(num_r, dtype=np.int64)
        num_accepted = np.zeros(num_r, dtype=np.int64)
        next_prompt = np.zeros(num_r, dtype=np.int64)
        for i, r in enumerate(rq):
            c, ql, d = r.computed, int(q[i]), int(num_draft[i])
            if r.prefilling:
                if c + ql == r.spec.prompt_len:
                    sampled[i, 0] = tok(r, c + ql)
                    num_sampled[i] = 1
                else:
                    next_prompt[i] = tok(r, c + ql)
                continue
            a = 0
            while a < d and r.drafts[a] == tok(r, c + 1 + a):
                a += 1
            sampled[i, :a + 1] = [tok(r, c + 1 + j) for j in range(a + 1)]
            num_sampled[i], num_accepted[i], num_rejected[i] = a + 1, a, d - a

        # -- MTP draft prefill inputs (global), then the drafts
        valid = q - num_rejected
        last_idx = qsl[:-1] + (q if "last_token_ignores_rejections" in faults else valid) - 1
        dgi = np.empty_like(input_ids)
        dgi[:-1] = input_ids[1:]
        dgi[-1] = 0
        for i in range(num_r):
            j = int(qsl[i] + valid[i] - 1)
            dgi[j] = sampled[i, num_sampled[i] - 1] if num_sampled[i] > 0 else next_prompt[i]
        drafts = np.zeros((num_r, k), dtype=np.int64)
        for i, r in enumerate(rq):
            nxt = r.computed + int(valid[i])  # next step's first position (L)
            for j in range(k):
                drafts[i, j] = draft_for(r, nxt + 1 + j, j)
        draft_pos = []
        pos = positions[last_idx]
        for j in range(1, k):
            if not (j >= 2 and "draft_positions_not_advanced" in faults):
                pos = pos + 1
            draft_pos.append(pos.copy())

        # -- record, per rank
        per_rank = []
        step_t0 = clock
        for rank in range(n):
            local = partition_batch(batch, rank, n, layout=layout)
            r_loc = local.num_reqs
            bt_local = gather_block_table_rows(full, local.idx_mapping, local.num_reqs_padded)[None]
            lqsl = local.query_start_loc[:r_loc + 1].astype(np.int64)
            lpos, lsl = local.positions, local.seq_lens[:r_loc].astype(np.int64)
            if "local_positions_from_cpu_cursor" in faults:
                lens = np.diff(lqsl)
                lpos = np.zeros_like(local.positions)
                lpos[:local.num_tokens] = (np.repeat(local.num_computed_tokens.astype(np.int64), lens)
                                           + np.arange(local.num_tokens) - np.repeat(lqsl[:-1], lens))
                lsl = np.where(lens > 0, lpos[np.maximum(lqsl[1:] - 1, 0)] + 1, 0)
            target = {
                "req_ids": np.array(batch.req_ids, dtype=str),
                "idx_mapping": idx_mapping,
                "num_scheduled_tokens": q,
                "num_computed_tokens": batch.num_computed_tokens.astype(np.int64),
                "query_start_loc": qsl,
                "positions": positions,
                "input_ids": input_ids,
                "seq_lens": seq_lens,
                "is_prefilling": prefilling,
                "logits_indices": logits_indices,
                "segments": segments_table(layout.segments_by_rank),
                "per_rank_num_tokens": np.array(layout.per_rank_num_tokens, dtype=np.int64),
                "padded_gather_idx": layout.padded_gather_idx,
                "hidden_restore_idx": layout.hidden_restore_idx,
                "kv_write_mask": layout.kv_write_mask,
                "local_req_ids": np.array(local.req_ids, dtype=str),
                "local_input_ids": local.input_ids.astype(np.int64),
                "local_positions": lpos,
                "local_query_start_loc": lqsl,
                "local_seq_lens": lsl,
                "local_logits_indices": local.logits_indices[:r_loc],
                "local_is_padding": local.is_padding,
                "local_is_prefilling": local.is_prefilling[:r_loc],
                "block_table_global": bt_global,
                "block_table_local": bt_local[:, :r_loc],
                "slot_mapping_global": slots_global,
                "slot_mapping_gathered": slots_gathered,
                "sampled_logits_rows": (local.logits_indices[:r_loc] if "sample_local_logits" in faults
                                        else logits_indices),
                "sampled_from": np.array("local" if "sample_local_logits" in faults else "global"),
            }
            phases = {"target": target}
            if k > 0:
                phases["draft_0"] = {
                    "view": np.array("rank_local"),
                    "draft_input_ids": dgi[local.gather_idx],
                    "draft_positions": lpos,
                    "draft_seq_lens": lsl,
                    "block_table_draft": bt_local[:, :r_loc],
                    "slot_mapping_draft": slots_gathered,
                    "draft_last_token_indices": last_idx,
                    "draft_tokens": drafts[:, 0],
                    "draft_global_input_ids": dgi,
                }
            for j in range(1, k):
                pj = draft_pos[j - 1]
                slots = draft_decode_slot_mapping(full, bs, idx_mapping, pj, **dcp_kw)
                phases[f"draft_{j}"] = {
                    "view": np.array("replicated"),
                    "draft_input_ids": drafts[:, j - 1],
                    "draft_positions": pj,
                    "draft_seq_lens": pj + 1,
                    "block_table_draft": (np.zeros_like(bt_global)
                                          if "skip_draft_block_table_gather" in faults else bt_global),
                    "slot_mapping_draft": (slots_gathered if "expanded_draft_slot_mapping" in faults
                                           else slots),
                    "draft_tokens": drafts[:, j],
                }
            phases["verify"] = {
                "req_ids": np.array(batch.req_ids, dtype=str),
                "num_draft_tokens": num_draft,
                "sampled_token_ids": sampled,
                "num_sampled": num_sampled,
                "num_rejected": num_rejected,
                "num_accepted": num_accepted,
            }
            if timestamps:
                tt = step_t0 + 3.0 * rank
                for phase, views in phases.items():
                    if phase in ("target", "draft_0"):
                        dur = 20.0 + 0.05 * layout.padded_num_tokens
                    else:
                        dur = 5.0 + 0.1 * num_r
                    views["t_start_us"] = np.array(tt)
                    views["t_end_us"] = np.array(tt + dur)
                    tt += dur + 1.0
                clock = max(clock, tt + 10.0)
            per_rank.append(phases)
        steps.append((step, per_rank))

        # -- advance request state
        for i, r in enumerate(rq):
            r.computed += int(valid[i])
            r.lag = int(num_rejected[i])
            if num_sampled[i] > 0:
                r.last_token = int(sampled[i, num_sampled[i] - 1])
                r.output += [int(x) for x in sampled[i, :num_sampled[i]]]
                r.drafts = [int(x) for x in drafts[i]]
            if len(r.output) >= r.spec.max_new_tokens:
                outputs[r.spec.req_id] = r.output[:r.spec.max_new_tokens]
                running.remove(r)
                allocator.free(table.clear(r.slot))
                free_slots.append(r.slot)
        step += 1

    meta = {
        "producer": producer, "pcp": n, "dcp": dcp, "dcp_rank": 0,
        "num_speculative_tokens": k, "block_size": bs, "shard_decode_requests": shard,
        "model": "synthetic", "seed": seed, "max_num_batched_tokens": max_num_batched_tokens,
        "inject": sorted(faults), "num_requests": len(requests),
    }
    return SyntheticRun(meta, steps, outputs)


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
