"""Notebook 03's computations: the MTP drafter's inputs for one step laid out for reading
(``draft_inputs``, computed by ``pcpviz.reference.drafts``) and the notebook's worked step
(``draft_example``: PCP=2, K=3, a decode with 2 of 3 drafts rejected, a partial prefill chunk
and a CUDA-graph padding request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pcpviz.reference.batch import GlobalBatch
from pcpviz.reference.drafts import draft_decode_positions, draft_prefill_inputs, unwritten_rows
from pcpviz.reference.layout import PCPLayout, plan_layout

__all__ = ["STALE", "DraftInputs", "draft_inputs", "DraftExample", "draft_example"]

STALE = -1
"""Marks a draft input row ``prepare_prefill_inputs`` does not write: a rejected row keeps
whatever the buffer held. draft_0 still runs it and writes its K/V at the target's slot (the cursor
advances by ``valid`` only, so a later step writes that position again); it is only never sampled
(sampling reads ``last_token_indices``)."""


@dataclass(frozen=True)
class DraftInputs:
    """The MTP drafter's inputs for one step, on the global batch.

    ``input_ids`` is draft_0's input per global token (``STALE`` on rows past a request's
    valid ones); ``last_token_indices`` the row whose hidden state gives draft token 0 (graph
    padding requests: 0); ``decode_positions[s-1]`` / ``decode_seq_lens[s-1]`` are draft_s's
    position and ``seq_len`` per request (padding requests: ``seq_len`` 0)."""

    input_ids: np.ndarray  # int64[T]
    last_token_indices: np.ndarray  # int64[R_pad]
    decode_positions: np.ndarray  # int64[K-1, R]
    decode_seq_lens: np.ndarray  # int64[K-1, R_pad]

    def local_input_ids(self, layout: PCPLayout, rank: int) -> np.ndarray:
        """int64[P]: draft_0's ids on ``rank`` (``prepare_draft_prefill``: an ``index_select``
        with the rank's ``padded_gather_idx`` slice; padding rows repeat global token 0's id)."""
        return self.input_ids[layout.local_gather_idx(rank)]


def draft_inputs(batch: GlobalBatch, *, num_sampled: Sequence[int], num_rejected: Sequence[int],
                 last_sampled: Sequence[int], next_prefill_tokens: Sequence[int],
                 num_speculative_tokens: int, num_reqs_padded: int | None = None) -> DraftInputs:
    """``prepare_prefill_inputs`` then ``prepare_decode_inputs`` (advancing positions), computed by
    ``pcpviz.reference.drafts`` and laid out for the notebook (rows the prefill does not write
    marked ``STALE``, padding requests appended).

    Per request ``i`` with ``q`` query rows of which ``num_rejected`` were rejected drafts:

    * valid rows ``q - num_rejected``; row ``j < valid-1`` takes the target id of row ``j+1``;
      the last valid row takes ``last_sampled[i]``, or ``next_prefill_tokens[i]`` when
      ``num_sampled == 0`` (a partial prefill chunk: nothing was sampled);
    * ``last_token_indices[i] = query_start + valid - 1``;
    * draft_1: position = ``positions[last_token_indices[i]] + 1``,
      ``seq_len = seq_len_target - num_rejected + 1``; each later step adds 1 to both.

    ``last_sampled`` / ``next_prefill_tokens`` are given per batch row here (vLLM indexes them
    by request-state slot). PCP=2 example: a decode at positions 20..23 with 2 of its 3 drafts
    rejected samples at row 1 (position 21); draft_1 runs at position 22 with seq_len 23::

        >>> b = GlobalBatch.build([4], [20], prefill_len=[10], input_ids=[5, 6, 7, 8])
        >>> d = draft_inputs(b, num_sampled=[2], num_rejected=[2], last_sampled=[9],
        ...                  next_prefill_tokens=[0], num_speculative_tokens=3)
        >>> d.input_ids.tolist(), d.last_token_indices.tolist(), d.decode_seq_lens[:, 0].tolist()
        ([6, 9, -1, -1], [1], [23, 24])
    """
    r = batch.num_reqs
    pad = r if num_reqs_padded is None else int(num_reqs_padded)
    if pad < r:
        raise ValueError(f"num_reqs_padded {pad} < {r} requests")
    arrays = {name: np.asarray(v, dtype=np.int64) for name, v in (
        ("num_sampled", num_sampled), ("num_rejected", num_rejected), ("last_sampled", last_sampled),
        ("next_prefill_tokens", next_prefill_tokens))}
    for name, a in arrays.items():
        if a.shape != (r,):
            raise ValueError(f"{name} needs one entry per request ({r}), got shape {a.shape}")
    ids, last = draft_prefill_inputs(batch.input_ids, batch.query_start_loc, num_rejected=arrays["num_rejected"],
                                     num_sampled=arrays["num_sampled"], last_sampled=arrays["last_sampled"],
                                     next_prompt_tokens=arrays["next_prefill_tokens"])
    ids[unwritten_rows(batch.query_start_loc, last)] = STALE
    dpos = draft_decode_positions(batch.positions, last, int(num_speculative_tokens))  # int64[K-1, R]
    dlen = np.zeros((dpos.shape[0], pad), dtype=np.int64)  # graph padding requests: seq_len 0
    dlen[:, :r] = dpos + 1
    last_padded = np.zeros(pad, dtype=np.int64)
    last_padded[:r] = last
    return DraftInputs(ids, last_padded, dpos, dlen)


@dataclass(frozen=True)
class DraftExample:
    """Notebook 03's worked step (PCP=2, K=3): ``d0`` decodes at positions 20..23 carrying 3
    drafts, 2 rejected; ``p1`` is the first 6-token chunk of a 10-token prompt (nothing
    sampled); one CUDA-graph padding request (``num_reqs_padded = 3``)."""

    batch: GlobalBatch
    num_sampled: np.ndarray
    num_rejected: np.ndarray
    last_sampled: np.ndarray
    next_prefill_tokens: np.ndarray
    num_speculative_tokens: int
    num_reqs_padded: int
    layout: PCPLayout

    def inputs(self) -> DraftInputs:
        return draft_inputs(self.batch, num_sampled=self.num_sampled, num_rejected=self.num_rejected,
                            last_sampled=self.last_sampled, next_prefill_tokens=self.next_prefill_tokens,
                            num_speculative_tokens=self.num_speculative_tokens,
                            num_reqs_padded=self.num_reqs_padded)


def draft_example() -> DraftExample:
    # d0: last sampled 120 at position 20, drafts 121 122 123; the target accepted 121, then
    # sampled 131 instead of 122 (so 122, 123 are rejected: num_sampled 2, num_rejected 2).
    # p1: prompt ids 200..209, this step schedules 200..205; its next prompt token is 206.
    batch = GlobalBatch.build([4, 6], [20, 0], prefill_len=[12, 10], req_ids=["d0", "p1"],
                              input_ids=[120, 121, 122, 123, 200, 201, 202, 203, 204, 205])
    return DraftExample(batch, np.array([2, 0]), np.array([2, 0]), np.array([131, 0]), np.array([0, 206]),
                        3, 3, plan_layout([4, 6], [False, True], 2))
