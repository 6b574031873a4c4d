"""The exercises of notebooks 01-03: each a question, its answer computed with the library,
and why (``check(name, answer)``; ``None`` reveals it).

    >>> check("empty_tail_chunk", None).startswith("answer: [2, 3]")
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pcpviz.reference.batch import order_batch
from pcpviz.reference.layout import PCPLayout, plan_layout
from pcpviz.teaching.examples.draft_steps import draft_example
from pcpviz.teaching.examples.kv_writes import block_example, draft_decode_io

__all__ = ["Exercise", "EXERCISES", "check"]


@dataclass(frozen=True)
class Exercise:
    name: str
    notebook: str
    question: str
    solve: Callable[[], Any]  # the answer, computed with the library
    why: str


def _owner_of(layout: PCPLayout, req: int) -> int:
    return next(r for r, segs in enumerate(layout.segments_by_rank) for s in segs if s.global_req_idx == req)


def _scheduler_names() -> list[str]:
    # K = 3: decode_query_len = 4. Inputs: prefill p (13), decodes d (1 token) and e (4 = 1 + 3 drafts).
    return order_batch([13], [1, 4], prefill_names=["p"], decode_names=["d", "e"])[2]


def _write_slot_a_without_gather() -> int:
    ex = block_example()
    io = draft_decode_io(ex.table.as_array(), ex.block_size, ex.idx_mapping, positions=ex.draft_positions,
                         input_block_tables=ex.stale_input_block_tables)
    return int(io.slot_mapping[1])


def _read_blocks_a_without_gather() -> list[int]:
    ex = block_example()
    io = draft_decode_io(ex.table.as_array(), ex.block_size, ex.idx_mapping, positions=ex.draft_positions,
                         input_block_tables=ex.stale_input_block_tables)
    return list(io.read_blocks[1])


EXERCISES: dict[str, Exercise] = {e.name: e for e in (
    Exercise("empty_tail_chunk", "01",
             "PCP=2, a fresh 5-token prefill alone in the batch. How many tokens does each rank "
             "compute? Answer [rank 0, rank 1].",
             lambda: list(plan_layout([5], [True], 2).per_rank_num_tokens),
             "4 chunks of ceil(5/4) = 2: [0:2] [2:4] [4:5] and an empty 4th chunk; rank 0 takes "
             "chunks 0 and 3 (the empty one is skipped), rank 1 chunks 1 and 2."),
    Exercise("decode_owner_moves", "01",
             "PCP=2, sharded decodes. Step A schedules the 1-token decodes a then b; in step B a has "
             "finished and b decodes alone. Which rank owns b in step A, and in step B? Answer [A, B].",
             lambda: [_owner_of(plan_layout([1, 1], [False, False], 2), 1),
                      _owner_of(plan_layout([1], [False], 2), 0)],
             "the owner is decode_ordinal % N, counted over this step's decodes only; ownership "
             "does not persist (every rank holds the whole KV, so it need not)."),
    Exercise("scheduler_order", "01",
             "K=3. The scheduler hands over a 13-token prefill p, a plain decode d (1 token) and a "
             "decode e carrying 3 drafts. In which order does vLLM put the rows? Answer a list of names.",
             _scheduler_names,
             "sort_batch_req_ids sorts by (no drafts, query != 1+K, query length): e has drafts; d "
             "and p both differ from 1+K = 4, so they go by length."),
    Exercise("skip_gather_write_slot", "02",
             "In the example, the gather before the draft decodes is skipped. Which slot does "
             "draft_1 write for request a (position 6)?",
             _write_slot_a_without_gather,
             "the slot comes from the request-indexed table through idx_mapping (compute_slot_mappings), "
             "not from input_block_tables: block 3, offset 2 -> 3*4 + 2 = 14, gather or not."),
    Exercise("skip_gather_read_blocks", "02",
             "Same step, gather skipped: which blocks does draft_1's attention read for request a? "
             "Answer a list of block ids.",
             _read_blocks_a_without_gather,
             "attention reads input_block_tables[:R], which the PCP target path never writes: all "
             "zeros, the null block, for both of a's blocks."),
    Exercise("last_token_indices", "03",
             "In the worked step, predict last_token_indices for [d0, p1, padding request].",
             lambda: draft_example().inputs().last_token_indices.tolist(),
             "d0: rows 0..3, 2 rejected -> 2 valid -> row 0 + 2 - 1 = 1; p1: rows 4..9, nothing "
             "rejected -> 9; a padding request gets 0."),
    Exercise("draft1_seq_len", "03",
             "d0's target seq_len is 24 (positions 20..23). What seq_len does draft_1 use for d0?",
             lambda: int(draft_example().inputs().decode_seq_lens[0, 0]),
             "prepare_decode_inputs: seq_len = target seq_len - num_rejected + 1 = 24 - 2 + 1; "
             "draft_1 sits at position 22 (the last valid position 21, plus 1)."),
    Exercise("partial_prefill_last_id", "03",
             "p1 is a partial prefill (num_sampled == 0). Which token id does its last draft_0 row "
             "(global row 9) get?",
             lambda: int(draft_example().inputs().input_ids[9]),
             "nothing was sampled, so the last valid row takes next_prefill_tokens: the prompt's "
             "next token, 206."),
)}


def _norm(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return _norm(x.tolist())
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def check(name: str, answer: Any) -> str:
    """Compare ``answer`` with the exercise's computed answer; ``None`` reveals it.

        >>> check("empty_tail_chunk", [2, 3]).startswith("right")
        True
    """
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; known: {', '.join(EXERCISES)}")
    ex = EXERCISES[name]
    expected = _norm(ex.solve())
    if answer is None:
        return f"answer: {expected!r} — {ex.why}"
    if _norm(answer) == expected:
        return f"right: {expected!r} — {ex.why}"
    return f"not quite: you said {_norm(answer)!r}, the library computes {expected!r} — {ex.why}"
