"""Greedy verification of draft tokens (rejection sampling at temperature 0).

For a decode row carrying d drafts the target's argmax at its 1+d sampled rows
is ``t_0 .. t_d``; draft j is accepted while ``draft_j == t_j`` for every
earlier j. With a accepted drafts the row emits ``t_0 .. t_a`` (a + 1 tokens:
the accepted drafts and one bonus/correction token) and rejects ``d - a``.
A prefill chunk that completes its prompt emits its one sampled token; a
partial chunk emits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Verification", "greedy_verify"]


@dataclass(frozen=True)
class Verification:
    sampled: list[list[int]]  # per row, the emitted tokens
    sampled_token_ids: np.ndarray  # int64[R, K+1], -1 padded
    num_sampled: np.ndarray  # int32[R]
    num_rejected: np.ndarray  # int32[R]
    num_accepted: np.ndarray  # int32[R]
    accepted_per_pos: np.ndarray  # int64[K]: rows whose draft at position k was accepted


def greedy_verify(batch, num_draft: np.ndarray, targets: np.ndarray, *, states, k: int,
                  accept_one_less: bool = False) -> Verification:
    r = batch.num_reqs
    sampled_ids = np.full((r, k + 1), -1, dtype=np.int64)
    num_sampled = np.zeros(r, dtype=np.int32)
    num_rejected = np.zeros(r, dtype=np.int32)
    num_accepted = np.zeros(r, dtype=np.int32)
    per_pos = np.zeros(max(k, 0), dtype=np.int64)
    sampled: list[list[int]] = []
    cursor = 0
    for i, req_id in enumerate(batch.req_ids):
        d = int(num_draft[i])
        rows = targets[cursor : cursor + d + 1]
        cursor += d + 1
        st = states[req_id]
        q = int(batch.num_scheduled_tokens[i])
        if batch.is_prefilling[i] and st.num_computed + q < st.prompt_len:
            sampled.append([])  # partial prefill chunk: the sample is discarded
            continue
        drafts = batch.input_ids[batch.query_start_loc[i + 1] - d : batch.query_start_loc[i + 1]]
        a = 0
        while a < d and int(drafts[a]) == int(rows[a]):
            a += 1
        if accept_one_less and a > 0:
            a -= 1  # fault: this rank disagrees with rank 0
        out = [int(x) for x in rows[: a + 1]]
        sampled.append(out)
        sampled_ids[i, : a + 1] = out
        num_sampled[i] = a + 1
        num_rejected[i] = d - a
        num_accepted[i] = a
        per_pos[:a] += 1
    return Verification(sampled, sampled_ids, num_sampled, num_rejected, num_accepted, per_pos)
