"""Plain records of one step's batch: the scheduler-ordered global batch and a
PCP rank's local batch. NumPy only; producers convert their tensors to these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["GlobalBatch", "LocalBatch", "scheduler_row_order", "order_batch", "query_start_loc",
           "record_query_start_loc"]


def query_start_loc(num_scheduled_tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """int64[R+1]: where each row's tokens start in the global batch, and T last (vLLM's
    ``query_start_loc``). PCP=2, rows of 9 and 1 tokens::

        >>> query_start_loc([9, 1]).tolist()
        [0, 9, 10]
    """
    q = np.asarray(num_scheduled_tokens, dtype=np.int64).reshape(-1)
    out = np.zeros(q.shape[0] + 1, dtype=np.int64)
    np.cumsum(q, out=out[1:])
    return out


def record_query_start_loc(rec: Any) -> np.ndarray | None:
    """int64[R+1] of a recorded global batch (a trace's ``target`` record, or any mapping of its
    views): from ``num_scheduled_tokens``, else the recorded ``query_start_loc``; None without
    either. The one place a record's ``query_start_loc`` is rebuilt (diff, timelines, the checks
    and the figures call it)::

        >>> record_query_start_loc({"num_scheduled_tokens": np.array([9, 1])}).tolist()
        [0, 9, 10]
    """
    if "num_scheduled_tokens" in rec:
        return query_start_loc(rec["num_scheduled_tokens"])
    if "query_start_loc" in rec:
        return np.asarray(rec["query_start_loc"], dtype=np.int64)
    return None


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """The global batch as ``GPUModelRunner.prepare_inputs`` builds it (before PCP).

    ``num_computed_tokens`` is the CPU cursor, an *upper bound* after a
    speculative rejection; ``positions`` come from the GPU cursor, which is the
    truth. The two agree unless drafts were rejected in the previous step.
    """

    req_ids: tuple[str, ...]  # R
    idx_mapping: np.ndarray  # int64[R]: request-state slot (block-table row) of each row
    num_scheduled_tokens: np.ndarray  # int64[R]
    num_computed_tokens: np.ndarray  # int64[R]: CPU cursor (upper bound)
    positions: np.ndarray  # int64[T]
    input_ids: np.ndarray  # int64[T]
    prefill_len: np.ndarray  # int64[R]: prompt length (tokens that count as prefill)
    is_prefilling: np.ndarray  # bool[R]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())

    @property
    def query_start_loc(self) -> np.ndarray:  # int64[R+1]
        return query_start_loc(self.num_scheduled_tokens)

    @property
    def seq_lens(self) -> np.ndarray:  # int64[R]: GPU view, last position + 1
        qsl = self.query_start_loc
        out = np.zeros(self.num_reqs, dtype=np.int64)
        has = self.num_scheduled_tokens > 0
        out[has] = self.positions[qsl[1:][has] - 1] + 1
        out[~has] = self.num_computed_tokens[~has]
        return out

    @classmethod
    def build(
        cls,
        num_scheduled_tokens: Sequence[int],
        num_computed_tokens: Sequence[int],
        *,
        prefill_len: Sequence[int] | None = None,
        is_prefilling: Sequence[bool] | None = None,
        req_ids: Sequence[str] | None = None,
        idx_mapping: Sequence[int] | None = None,
        input_ids: Sequence[int] | None = None,
        positions: Sequence[int] | None = None,
    ) -> "GlobalBatch":
        """A batch with defaults filled in: positions from the cursors, a row
        prefilling iff ``num_computed < prefill_len``, ``idx_mapping = arange``,
        and token ids equal to positions (handy for eyeballing layouts)."""
        q = np.asarray(num_scheduled_tokens, dtype=np.int64)
        nc = np.asarray(num_computed_tokens, dtype=np.int64)
        r = q.shape[0]
        if nc.shape != (r,):
            raise ValueError(f"num_computed_tokens needs {r} entries, got {nc.shape}")
        pl = nc + q if prefill_len is None else np.asarray(prefill_len, dtype=np.int64)
        pf = nc < pl if is_prefilling is None else np.asarray(is_prefilling, dtype=np.bool_)
        if positions is None:
            pos = np.concatenate([np.arange(c, c + n) for c, n in zip(nc, q)] or [[]])
        else:
            pos = np.asarray(positions)
        pos = pos.astype(np.int64)
        ids = pos.copy() if input_ids is None else np.asarray(input_ids, dtype=np.int64)
        if pos.shape != (int(q.sum()),) or ids.shape != pos.shape:
            raise ValueError(f"positions/input_ids need {int(q.sum())} entries")
        rid = tuple(req_ids) if req_ids is not None else tuple(f"r{i}" for i in range(r))
        idx = np.arange(r, dtype=np.int64) if idx_mapping is None else np.asarray(idx_mapping, dtype=np.int64)
        return cls(rid, idx, q, nc, pos, ids, pl, pf)


@dataclass(frozen=True, eq=False)
class LocalBatch:
    """One PCP rank's local batch, as ``PCPManager.partition_batch`` returns it.

    Rows are segments (a request may appear twice: head and tail chunk).
    Arrays sized ``num_reqs_padded`` carry padding rows past ``num_reqs``.
    """

    rank: int
    req_ids: tuple[str, ...]  # R_loc
    global_req_idx: np.ndarray  # int64[R_loc]: global row of each local row
    idx_mapping: np.ndarray  # int64[R_loc]: request-state slot, repeats allowed
    num_scheduled_tokens: np.ndarray  # int32[R_loc]
    num_tokens: int
    num_tokens_padded: int  # P
    num_reqs: int  # R_loc
    num_reqs_padded: int
    query_start_loc: np.ndarray  # int32[R_loc_pad+1]; padded tail = num_tokens
    input_ids: np.ndarray  # int32[P]; padding 0
    positions: np.ndarray  # int64[P]; padding 0
    seq_lens: np.ndarray  # int32[R_loc_pad]: last local position + 1; padding 0
    logits_indices: np.ndarray  # int64[R_loc_pad]: query_start_loc[1:] - 1 (never sampled)
    is_prefilling: np.ndarray  # bool[R_loc_pad]
    is_padding: np.ndarray  # bool[P]
    num_computed_tokens: np.ndarray  # int32[R_loc]: CPU cursor + chunk offset
    seq_lens_cpu_upper_bound: np.ndarray  # int32[R_loc_pad]
    gather_idx: np.ndarray  # int64[P]: global token of each local row
    global_query_lens: np.ndarray  # int32[R_loc]: the whole request's query length
    is_placeholder: bool  # the rank had no rows; one empty row for global row 0


def scheduler_row_order(
    num_tokens: Sequence[int], has_drafts: Sequence[bool], decode_query_len: int
) -> list[int]:
    """The global row order vLLM 0.33.0 gives the scheduled requests
    (``sort_batch_req_ids``): requests carrying drafts first, then those whose
    query is exactly ``decode_query_len`` (1 + K), then by query length; stable.
    Returns indices into the inputs."""
    keys = [(not d, n != decode_query_len, n) for n, d in zip(num_tokens, has_drafts)]
    return sorted(range(len(keys)), key=keys.__getitem__)


def order_batch(
    prefill_lens: Sequence[int], decode_query_lens: Sequence[int], *,
    prefill_names: Sequence[str] | None = None, decode_names: Sequence[str] | None = None,
) -> tuple[list[int], list[bool], list[str]]:
    """Prefills and decodes (query ``1`` = plain decode, ``1+K`` = K drafts) put in vLLM's row
    order: ``(query lengths, is_prefilling, names)``. K is the largest decode's drafts, so
    ``decode_query_len = 1 + K``. Default names: ``p0, p1, ...`` and ``d0, d1, ...``.

    K=3: a 13-token prefill, a plain decode and a decode carrying 3 drafts::

        >>> order_batch([13], [1, 4])
        ([4, 1, 13], [False, False, True], ['d1', 'd0', 'p0'])
    """
    lengths = [int(n) for n in prefill_lens] + [int(n) for n in decode_query_lens]
    prefill = [True] * len(prefill_lens) + [False] * len(decode_query_lens)
    names = list(prefill_names if prefill_names is not None else [f"p{i}" for i in range(len(prefill_lens))])
    names += list(decode_names if decode_names is not None else [f"d{i}" for i in range(len(decode_query_lens))])
    if len(names) != len(lengths):
        raise ValueError(f"{len(names)} names for {len(lengths)} rows")
    k = max([n - 1 for n in decode_query_lens] + [0])
    has_drafts = [not p and n > 1 for n, p in zip(lengths, prefill)]
    order = scheduler_row_order(lengths, has_drafts, 1 + k)
    return [lengths[i] for i in order], [prefill[i] for i in order], [names[i] for i in order]
