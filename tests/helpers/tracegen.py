"""Trace generators for the checks/diff/export tests.

Clean traces come from ``pcpviz.synthetic`` (re-exported here): every structural view is
computed by the pcpviz reference (``plan_layout``, ``partition_batch``, ``pcpviz.reference.blocks``).
Faulty traces are built two ways:

* ``generate(..., faults=[...])``: a known bug injected *consistently* (the rest of the step
  follows from the faulty value, as a real producer's would);
* ``corrupt(run, step, phase, view, fn, ranks=...)``: a targeted edit of recorded views.

``worked_example_run()`` is Scenario A, the PCP=2 step of ``docs/vllm-0.33-pcp-mtp.md``, with the
numbers vLLM 0.33.0 produced, written literally — an oracle independent of pcpviz.reference.layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from pcpviz.synthetic import RequestSpec, SyntheticRun, generate, long_prompt_run
from pcpviz.trace import SEGMENT_DTYPE
from pcpviz.trace.meta_model import RunMeta

__all__ = [
    "run_of_trace",
    "RequestSpec", "SyntheticRun", "generate", "long_prompt_run", "REQUESTS",
    "clean_run", "corrupt", "first_step", "worked_example_run",
]

# Fresh and chunked prefills (budget 24 chunks "a" and "c"), later arrivals next to running
# decodes, a 3-token prompt (shorter than 2N chunks under PCP=4), and enough new tokens for
# many decode steps with rejections.
REQUESTS = (
    RequestSpec("a", 40, 14),
    RequestSpec("b", 9, 12),
    RequestSpec("c", 23, 16, 2),
    RequestSpec("d", 3, 10, 1),
    RequestSpec("e", 17, 8, 5),
)


def clean_run(pcp: int = 2, k: int = 3, *, requests=REQUESTS, **kw) -> SyntheticRun:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_batched_tokens", 24)
    return generate(list(requests), pcp=pcp, num_speculative_tokens=k, **kw)


def corrupt(run: SyntheticRun, step: int, phase: str, view: str,
            fn: Callable[[np.ndarray], np.ndarray], ranks: Iterable[int] | None = None) -> None:
    """Replace ``view`` of ``phase`` at ``step`` on ``ranks`` (default: all) by
    ``fn(a writable copy)``."""
    for rank in (range(run.pcp) if ranks is None else ranks):
        views = run.views(step, rank, phase)
        views[view] = np.asarray(fn(np.array(views[view], copy=True)))


def first_step(run: SyntheticRun, pred: Callable[[dict], bool], rank: int = 0) -> int:
    """The first step whose phases (on ``rank``) satisfy ``pred``."""
    for step, per_rank in run.steps:
        if pred(per_rank[rank]):
            return step
    raise LookupError("no step matches")


def worked_example_run() -> SyntheticRun:
    """Scenario A (PCP=2, K=3, block_size 4, sharded decodes) with vLLM's numbers.

    Global rows: d0 decode+3 drafts at 20..23 (GPU cursor 20, CPU cursor 21), d1 decode at
    11..14 (2 of its 3 drafts rejected), p1 continued chunk 12..21, p0 fresh prefill 0..12.
    """
    req_ids = np.array(["d0", "d1", "p1", "p0"])
    q = np.array([4, 4, 10, 13])
    qsl = np.array([0, 4, 8, 18, 31])
    positions = np.concatenate([np.arange(20, 24), np.arange(11, 15), np.arange(12, 22), np.arange(0, 13)])
    # input ids chosen so that the draft prefill ids match the worked example's rank-0 list
    input_ids = np.array([40, 41, 42, 43, 50, 51, 52, 53,
                          80, 81, 82, 83, 84, 85, 86, 87, 88, 89,
                          55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67])
    table = {0: [1, 2, 3, 4, 5, 6, 7], 1: [9, 10, 11, 12], 2: [13, 14, 15, 18, 19, 20], 3: [23, 24, 25, 26]}
    width = 7
    bt = np.zeros((1, 4, width), dtype=np.int32)
    for r, row in table.items():
        bt[0, r, :len(row)] = row
    slot_global = np.array([[24, 25, 26, 27, 47, 48, 49, 50, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81,
                             92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104]])
    pgi = np.array([0, 1, 2, 3, 8, 9, 10, 17, 18, 19, 20, 21, 30, 0, 0, 0, 0, 0,
                    4, 5, 6, 7, 11, 12, 13, 14, 15, 16, 22, 23, 24, 25, 26, 27, 28, 29])
    hri = np.array([0, 1, 2, 3, 18, 19, 20, 21, 4, 5, 6, 22, 23, 24, 25, 26, 27, 7, 8, 9, 10, 11,
                    28, 29, 30, 31, 32, 33, 34, 35, 12])
    gathered = np.array([[24, 25, 26, 27, 72, 73, 74, 81, 92, 93, 94, 95, 104, -1, -1, -1, -1, -1,
                          47, 48, 49, 50, 75, 76, 77, 78, 79, 80, 96, 97, 98, 99, 100, 101, 102, 103]])
    mask = gathered[0] != -1
    seg = lambda *v: v  # noqa: E731  (global_req_idx, gstart, gstop, lstart, lstop, rank)
    segments = np.array([
        seg(0, 0, 4, 0, 4, 0), seg(2, 8, 11, 4, 7, 0), seg(2, 17, 18, 7, 8, 0),
        seg(3, 18, 22, 8, 12, 0), seg(3, 30, 31, 12, 13, 0),
        seg(1, 4, 8, 0, 4, 1), seg(2, 11, 14, 4, 7, 1), seg(2, 14, 17, 7, 10, 1),
        seg(3, 22, 26, 10, 14, 1), seg(3, 26, 30, 14, 18, 1),
    ], dtype=SEGMENT_DTYPE)
    local = {
        0: dict(req=[0, 2, 2, 3, 3], lqsl=[0, 4, 7, 8, 12, 13],
                pos=[20, 21, 22, 23, 12, 13, 14, 21, 0, 1, 2, 3, 12, 0, 0, 0, 0, 0],
                seq_lens=[24, 15, 22, 4, 13]),
        1: dict(req=[1, 2, 2, 3, 3], lqsl=[0, 4, 7, 10, 14, 18],
                pos=[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 4, 5, 6, 7, 8, 9, 10, 11],
                seq_lens=[15, 18, 21, 8, 12]),
    }
    # draft prefill: target ids shifted left within q - num_rejected, last valid row = sampled
    num_draft = np.array([3, 3, 0, 0])
    num_accepted = np.array([3, 1, 0, 0])
    num_rejected = num_draft - num_accepted
    sampled = np.full((4, 4), -1)
    sampled[0] = [41, 42, 43, 60]
    sampled[1, :2] = [51, 54]
    sampled[2, 0] = 90  # p1's chunk completes its prompt
    num_sampled = np.array([4, 2, 1, 0])  # p0 is a partial chunk: nothing sampled
    dgi = np.empty_like(input_ids)
    dgi[:-1], dgi[-1] = input_ids[1:], 0
    dgi[3], dgi[5], dgi[17], dgi[30] = 60, 54, 90, 73  # 73: p0's next prompt token
    last_idx = np.array([3, 5, 17, 30])
    logits = np.array([0, 1, 2, 3, 4, 5, 6, 7, 17, 30])
    draft_pos = [np.array([24, 13, 22, 13]), np.array([25, 14, 23, 14])]
    draft_slots = [np.array([[28, 49, 82, 105]]), np.array([[29, 50, 83, 106]])]
    tokens = [np.array([100, 101, 102, 103]), np.array([110, 111, 112, 113]), np.array([120, 121, 122, 123])]
    per_rank = []
    for rank in (0, 1):
        lc = local[rank]
        lqsl = np.array(lc["lqsl"])
        lpos = np.array(lc["pos"])
        n = int(lqsl[-1])
        p = 18
        gather = pgi[rank * p:(rank + 1) * p]
        btl = bt[:, lc["req"]]
        target = {
            "req_ids": req_ids, "idx_mapping": np.arange(4), "num_scheduled_tokens": q,
            "num_computed_tokens": np.array([21, 11, 12, 0]), "query_start_loc": qsl,
            "positions": positions, "input_ids": input_ids, "seq_lens": np.array([24, 15, 22, 13]),
            "is_prefilling": np.array([False, False, True, True]), "logits_indices": logits,
            "segments": segments, "per_rank_num_tokens": np.array([13, 18]), "padded_gather_idx": pgi,
            "hidden_restore_idx": hri, "kv_write_mask": mask,
            "local_req_ids": req_ids[lc["req"]], "local_input_ids": np.where(np.arange(p) < n, input_ids[gather], 0),
            "local_positions": lpos, "local_query_start_loc": lqsl, "local_seq_lens": np.array(lc["seq_lens"]),
            "local_logits_indices": lqsl[1:] - 1, "local_is_padding": np.arange(p) >= n,
            "block_table_global": bt, "block_table_local": btl,
            "slot_mapping_global": slot_global, "slot_mapping_gathered": gathered,
            "sampled_logits_rows": logits, "sampled_from": np.array("global"),
        }
        phases = {"target": target, "draft_0": {
            "view": np.array("rank_local"), "draft_input_ids": dgi[gather], "draft_positions": lpos,
            "draft_seq_lens": np.array(lc["seq_lens"]), "block_table_draft": btl,
            "slot_mapping_draft": gathered, "draft_last_token_indices": last_idx,
            "draft_tokens": tokens[0], "draft_global_input_ids": dgi,
        }}
        for k in (1, 2):
            phases[f"draft_{k}"] = {
                "view": np.array("replicated"), "draft_input_ids": tokens[k - 1],
                "draft_positions": draft_pos[k - 1], "draft_seq_lens": draft_pos[k - 1] + 1,
                "block_table_draft": bt, "slot_mapping_draft": draft_slots[k - 1],
                "draft_tokens": tokens[k],
            }
        phases["verify"] = {
            "req_ids": req_ids, "num_draft_tokens": num_draft, "sampled_token_ids": sampled,
            "num_sampled": num_sampled, "num_rejected": num_rejected, "num_accepted": num_accepted,
        }
        per_rank.append(phases)
    meta = RunMeta.build(producer="vllm-replay", pcp=2, dcp=1, num_speculative_tokens=3, block_size=4,
                         shard_decode_requests=True, model="worked-example")
    return SyntheticRun(meta, [(7, per_rank)], {})


def write(run: SyntheticRun, root: Path, name: str = "trace") -> Path:
    return run.write(Path(root) / name)


def run_of_trace(path: Path | str) -> SyntheticRun:
    """A recorded trace as a mutable ``SyntheticRun`` (to corrupt a real producer's views)."""
    from pcpviz import trace as pt

    t = pt.open(path)
    steps = [(s, [{ph: {v: np.array(t.record(s, r, ph)[v], copy=True) for v in t.record(s, r, ph).keys()}
                   for ph in t.phases(s, r)} for r in t.ranks]) for s in t.steps]
    return SyntheticRun(t.run_meta, steps, {})

