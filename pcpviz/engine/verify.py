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
    """Verify the rows of one step.

    ``targets`` int64[sum(num_draft + 1)] holds each row's 1 + d sampled argmaxes in batch
    order. Worked example, K = 2: a decode d0 with drafts [5, 9] whose targets are [5, 7, 3],
    and a prefill p1 that completes its prompt with target [4]::

        match            d0: [5==5, 9==7] = [T, F]   -> accepted a = 1 (stops at the first miss)
        sampled          d0: [5, 7] (a + 1 tokens)    p1: [4]
        num_rejected     d0: 2 - 1 = 1                p1: 0
        accepted_per_pos [1, 0]

    A short loop over Python lists: a decode step's rows are few and carry at most K drafts,
    and at batch 1 to 64 this is faster than array operations (each NumPy call costs more than
    a row's work)."""
    r = batch.num_reqs
    drafts_of = num_draft[:r].tolist()
    if r and max(drafts_of) > k:
        raise ValueError(f"a row carries {max(drafts_of)} drafts, more than K = {k}")
    tgt = np.asarray(targets).tolist()
    q = batch.num_scheduled_tokens.tolist()
    prefilling = batch.is_prefilling.tolist()
    ends = np.cumsum(batch.num_scheduled_tokens).tolist()
    ids = batch.input_ids
    sampled: list[list[int]] = []
    padded = []  # rows of sampled_token_ids
    num_sampled, num_rejected, num_accepted = [0] * r, [0] * r, [0] * r
    per_pos = [0] * max(k, 0)
    cursor = 0
    for i, req_id in enumerate(batch.req_ids):
        d = drafts_of[i]
        rows = tgt[cursor: cursor + d + 1]
        cursor += d + 1
        st = states[req_id]
        if prefilling[i] and st.num_computed + q[i] < st.prompt_len:
            sampled.append([])  # partial prefill chunk: the sample is discarded
            padded.append([-1] * (k + 1))
            continue
        drafts = ids[ends[i] - d: ends[i]].tolist() if d else []
        a = 0
        while a < d and drafts[a] == rows[a]:
            a += 1
        if accept_one_less and a > 0:
            a -= 1  # fault: this rank disagrees with rank 0
        out = rows[: a + 1]
        sampled.append(out)
        padded.append(out + [-1] * (k - a))
        num_sampled[i], num_rejected[i], num_accepted[i] = a + 1, d - a, a
        for j in range(a):
            per_pos[j] += 1
    return Verification(sampled, np.array(padded, dtype=np.int64).reshape(r, k + 1),
                        np.array(num_sampled, dtype=np.int32), np.array(num_rejected, dtype=np.int32),
                        np.array(num_accepted, dtype=np.int32), np.array(per_pos, dtype=np.int64))
