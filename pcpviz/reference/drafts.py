"""The MTP drafter's input arithmetic on the global batch: the NumPy reference of vLLM 0.33.0's
``prepare_prefill_inputs`` and ``prepare_decode_inputs``
(``vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py``), re-derived.

One home for it: the engine's speculator (``pcpviz.engine.speculator``), the synthetic generator
(``pcpviz.synthetic``) and the checks' expected values (``pcpviz.analysis.checks``) all call
these functions.

* **draft prefill** (``draft_prefill_inputs``): request ``i`` has ``q`` query rows of which
  ``num_rejected`` were rejected drafts, so ``valid = q - num_rejected`` rows; row ``j <
  valid - 1`` takes the target id of row ``j + 1``; the last valid row (``last_token_indices[i]
  = query_start + valid - 1``) takes the token just sampled, or, when nothing was sampled (a
  partial prefill chunk), the prompt token after the chunk. Rows past the valid ones are not
  written but not skipped: draft_0 runs them and writes their K/V at the target's slots (later
  steps write those positions again); they are only never sampled. Here they keep the shifted ids
  (the last global row keeps its own id).
* **draft decodes** (``draft_decode_positions``): draft_1 runs at
  ``positions[last_token_indices] + 1``, every later step one further, seq_len = position + 1
  (vLLM clamps both at ``max_model_len``).

PCP=2 example (K=3): a decode at positions 20..23 with ids [5, 6, 7, 8], 2 of its 3 drafts
rejected, 9 sampled last; a 4-token partial prefill chunk [1, 2, 3, 4] of a longer prompt whose
next token is 11::

    >>> ids, last = draft_prefill_inputs(np.array([5, 6, 7, 8, 1, 2, 3, 4]), np.array([0, 4, 8]),
    ...     num_rejected=[2, 0], num_sampled=[2, 0], last_sampled=[9, -1], next_prompt_tokens=[-1, 11])
    >>> ids.tolist(), last.tolist()
    ([6, 9, 8, 1, 2, 3, 4, 11], [1, 7])
    >>> draft_decode_positions(np.array([20, 21, 22, 23, 0, 1, 2, 3]), last, 3).tolist()
    [[22, 4], [23, 5]]
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["draft_prefill_inputs", "unwritten_rows", "draft_decode_positions", "partial_chunk_rows"]


def draft_prefill_inputs(input_ids: np.ndarray, query_start_loc: np.ndarray, *,
                         num_rejected: Sequence[int], num_sampled: Sequence[int],
                         last_sampled: Sequence[int], next_prompt_tokens: Sequence[int],
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(draft input ids int64[T], last_token_indices int64[R]) of the draft prefill (see the
    module doc). ``last_sampled[i]``: the last token sampled for row ``i`` this step (read
    where ``num_sampled[i] > 0``); ``next_prompt_tokens[i]``: the prompt token after row
    ``i``'s chunk (read where nothing was sampled). A row with no valid token writes nothing."""
    ids = np.asarray(input_ids, dtype=np.int64)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    out = np.empty_like(ids)
    if ids.size:
        out[:-1] = ids[1:]
        out[-1] = ids[-1]
    valid = np.diff(qsl) - np.asarray(num_rejected, dtype=np.int64)
    last = (qsl[:-1] + valid - 1).astype(np.int64)  # int64[R]
    tok = np.where(np.asarray(num_sampled, dtype=np.int64) > 0, np.asarray(last_sampled, dtype=np.int64),
                   np.asarray(next_prompt_tokens, dtype=np.int64))
    ok = valid > 0
    out[last[ok]] = tok[ok]
    return out, last


def unwritten_rows(query_start_loc: np.ndarray, last_token_indices: np.ndarray) -> np.ndarray:
    """bool[T]: the rows ``prepare_prefill_inputs`` does not write, those past each request's last
    valid row (its rejected drafts). vLLM's buffer keeps whatever it held there; draft_0 still
    runs those rows (and writes their K/V), they are only never sampled. With the module
    example's ``last`` = [1, 7]: rows 2 and 3 (d0's two rejected drafts)::

        >>> unwritten_rows(np.array([0, 4, 8]), np.array([1, 7])).nonzero()[0].tolist()
        [2, 3]
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lti = np.asarray(last_token_indices, dtype=np.int64)[: qsl.size - 1]
    rows = np.arange(int(qsl[-1]) if qsl.size else 0, dtype=np.int64)  # int64[T]
    req = np.searchsorted(qsl[1:], rows, side="right")  # int64[T]: each row's request
    return rows > lti[req] if rows.size else np.zeros(0, dtype=bool)


def draft_decode_positions(positions: np.ndarray, last_token_indices: np.ndarray, k: int, *,
                           max_model_len: int | None = None) -> np.ndarray:
    """int64[K-1, R]: the position of every request in draft steps 1..K-1 (seq_len is one more),
    ``positions[last_token_indices] + s`` for step ``s``, clamped at ``max_model_len - 1``."""
    pos = np.asarray(positions, dtype=np.int64)
    lti = np.asarray(last_token_indices, dtype=np.int64)
    first = pos[lti] if lti.size else np.zeros(0, np.int64)
    out = first[None, :] + np.arange(1, max(int(k), 1), dtype=np.int64)[:, None]
    return out if max_model_len is None else np.minimum(out, int(max_model_len) - 1)


def partial_chunk_rows(num_sampled: np.ndarray, num_scheduled_tokens: np.ndarray) -> np.ndarray:
    """int64[n]: the batch rows that sampled nothing although scheduled (partial prefill
    chunks): their last draft-prefill id is the prompt's next token, known only to the step
    that schedules the next chunk."""
    ns = np.asarray(num_sampled, dtype=np.int64)
    q = np.asarray(num_scheduled_tokens, dtype=np.int64)
    return np.flatnonzero((ns == 0) & (q > 0)).astype(np.int64)
