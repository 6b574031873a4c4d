"""``generate``: simulate synthetic requests to completion and record every step on every
rank; ``long_prompt_run``, the benchmark scenario. The scheduler, the block allocator and the
request state live here (``_Simulation``), each step's values in ``step`` and ``phases``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from pcpviz import faults as F
from pcpviz.faults import SYNTHETIC, active_faults
from pcpviz.reference.blocks import BlockAllocator, BlockTable
from pcpviz.synthetic.phases import add_timestamps, rank_phases
from pcpviz.synthetic.run import SyntheticRun
from pcpviz.synthetic.settings import Req, RequestSpec, Settings, check_settings
from pcpviz.trace.meta_model import RunMeta
from pcpviz.synthetic.step import Drafts, Step, Verify, draft_step, global_step, step_layout, step_slots, verify

__all__ = ["generate", "long_prompt_run"]


class _Simulation:
    """The scheduler, the block allocator and the request state of one ``generate`` call."""

    def __init__(self, requests: Sequence[RequestSpec], s: Settings) -> None:
        self.s = s
        max_len = max((r.prompt_len + r.max_new_tokens for r in requests), default=1) + 2 * s.k + 2
        width = -(-max_len // (s.block_size * s.dcp)) + 1
        self.allocator = BlockAllocator(s.max_num_reqs * width + 1, s.block_size)
        self.table = BlockTable(s.max_num_reqs, width)
        self.free_slots = list(range(s.max_num_reqs - 1, -1, -1))
        self.pending = sorted([(spec, i) for i, spec in enumerate(requests)], key=lambda x: (x[0].arrival_step, x[1]))
        self.running: list[Req] = []
        self.admitted: list[Req] = []
        self.outputs: dict[str, list[int]] = {}
        self.clock = 0.0

    # -- scheduling
    def admit(self, step: int) -> None:
        while self.pending and self.pending[0][0].arrival_step <= step and self.free_slots:
            spec, key = self.pending.pop(0)
            rng = np.random.default_rng([self.s.seed, key])
            req = Req(spec, key, rng.integers(0, self.s.vocab_size, spec.prompt_len), self.free_slots.pop())
            self.running.append(req)
            self.admitted.append(req)

    def schedule(self) -> list[tuple[Req, int]]:
        """Decodes first, then prefill chunks, within the token budget: ``[(request, q)]``."""
        budget = self.s.max_num_batched_tokens
        picked: list[tuple[Req, int]] = []
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

    def allocate(self, picked: list[tuple[Req, int]], on: frozenset[str]) -> np.ndarray:
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
    def advance(self, st: Step, v: Verify, d: Drafts) -> None:
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
    dcp_interleave: int = 1,
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
    slot mappings for DCP rank 0 (runs of ``dcp_interleave`` tokens), as vLLM
    does; ``shard_decode_requests`` overrides the
    decode placement (default: vLLM's rule, sharded iff PCP > 1 and DCP == 1).
    ``graph_pad`` rounds P up to a multiple (a CUDA-graph size). ``reverse_rows`` reverses the
    global row order (a producer that orders rows differently; results are unchanged).
    ``faults``: names (or ``NAME@STEP``) from ``pcpviz.faults.faults_of(SYNTHETIC)``.
    """
    s = check_settings(requests, pcp=pcp, num_speculative_tokens=num_speculative_tokens, block_size=block_size,
                  dcp=dcp, shard_decode_requests=shard_decode_requests, accept_prob=accept_prob,
                  faults=faults, vocab_size=vocab_size, seed=seed, max_num_batched_tokens=max_num_batched_tokens,
                  max_num_reqs=max_num_reqs, graph_pad=graph_pad, timestamps=timestamps, reverse_rows=reverse_rows,
                  dcp_interleave=int(dcp_interleave))
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
            st = global_step(picked, s, on)
            full = sim.allocate(picked, on)
            layout = step_layout(st, s, on)
            step_slots(st, layout, full=full, s=s)
            v = verify(st, s)
            d = draft_step(st, v, s, on=on)
            per_rank = []
            step_t0 = sim.clock
            for rank in range(s.pcp):
                phases = rank_phases(rank, st, layout, full=full, v=v, d=d, s=s, on=on)
                if s.timestamps:
                    end = add_timestamps(phases, step_t0 + 3.0 * rank, layout, num_r=len(st.rows))
                    sim.clock = max(sim.clock, end + 10.0)
                per_rank.append(phases)
            steps.append((step, per_rank))
            sim.advance(st, v, d)
        step += 1

    meta = RunMeta.build(
        producer=producer, pcp=s.pcp, dcp=dcp, dcp_rank=0, dcp_interleave=s.dcp_interleave,
        num_speculative_tokens=s.k, block_size=s.block_size, shard_decode_requests=s.shard,
        model="synthetic", seed=seed, max_num_batched_tokens=max_num_batched_tokens,
        inject=sorted(s.faults), num_requests=len(requests),
    )
    return SyntheticRun(meta, steps, sim.outputs)


def long_prompt_run(*, pcp: int = 4, prompt_len: int = 32_768, chunk: int = 8192,
                    num_short: int = 7, max_new_tokens: int = 96, num_speculative_tokens: int = 3,
                    block_size: int = 16, seed: int = 0, **dcp) -> SyntheticRun:
    """The benchmark scenario: one long prompt chunked over a few steps next to short requests,
    then tens of decode steps (PCP=4, K=3 by default); ``dcp=`` / ``dcp_interleave=`` pass to ``generate``."""
    reqs = [RequestSpec("long", prompt_len, max_new_tokens, 0)]
    reqs += [RequestSpec(f"s{i}", 200 + 150 * i, max_new_tokens // 2 + 4 * i, i % 3)
             for i in range(num_short)]
    return generate(reqs, pcp=pcp, num_speculative_tokens=num_speculative_tokens,
                    block_size=block_size, max_num_batched_tokens=chunk,
                    max_num_reqs=len(reqs) + 1, seed=seed, accept_prob=0.6, **dcp)
