"""Decode attention over DCP-sharded KV: each rank attends over its own shard, and the
``ag_rs`` backend combines the partial results (the NumPy reference of vLLM 0.33.0's
``cp_lse_ag_out_rs``, ``vllm/v1/attention/ops/dcp.py`` 471-500).

A rank's partial attention over its local keys returns an output ``o_r`` (normalised over *its*
keys) and the log-sum-exp ``lse_r`` of its scores (``-inf`` for an empty shard: a rank with
local_len 0, ``mask_dcp_empty_shards_``, 72-102). Softmax over the union of the shards is a
weighted sum of the partial outputs::

    lse   = log sum_r exp(lse_r)
    out   = sum_r exp(lse_r - lse) * o_r

``ag_rs`` does it in two collectives over the DCP group:

1. **all-gather** the ``[B, H]`` LSEs (every rank now holds ``[D, B, H]``);
2. each rank scales its own ``o_r`` by ``exp(lse_r - lse)`` (``correct_attn_out``, 376-435:
   NaN and +inf LSEs count as ``-inf``, a factor of 0 gives exactly 0);
3. **reduce-scatter** the scaled ``[B, H, Dv]`` outputs over the head axis: rank ``r`` receives the
   sum over ranks of heads ``r*H/D .. (r+1)*H/D``.

Before the attention the queries' heads were all-gathered over the group (each rank attends
with every head of the group); with PCP and DCP = PCP at TP=1 every rank already has all heads,
and after the reduce-scatter ``finalize_mla_pcp_decode`` all-gathers the head slices back over
PCP (``vllm/v1/attention/ops/pcp.py`` 106-115).

PCP=2, DCP=2 example (one query, one head, Dv=1; rank 0 holds keys with scores [0, 0] and
values [1, 3], rank 1 one key with score log 2 and value 6)::

    rank 0: o=2, lse=log 2      rank 1: o=6, lse=log 2      lse=log 4
    out = 2 * 1/2 + 6 * 1/2 = 4   (= (1 + 3 + 2*6) / 4, attention over all three keys)

    >>> o, l = lse_combine(np.array([[[[2.0]]], [[[6.0]]]]), np.log(np.array([[[2.0]], [[2.0]]])))
    >>> float(o[0, 0, 0]), round(float(np.exp(l[0, 0])), 6)
    (4.0, 4.0)
"""

from __future__ import annotations

import numpy as np

__all__ = ["partial_attention", "mask_empty_shards", "correct_rank_output", "lse_combine", "ag_rs_combine"]


def partial_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(out float64[B, H, Dv], lse float64[B, H]): attention of ``q [B, H, Dk]`` over one shard's
    ``k [B, S, H, Dk]`` and ``v [B, S, H, Dv]``; with no keys (S = 0) out is 0 and lse -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, h, _ = q.shape
    if k.shape[1] == 0:
        return np.zeros((b, h, v.shape[-1])), np.full((b, h), -np.inf)
    s = np.einsum("bhd,bshd->bhs", q, k) * scale  # float64[B, H, S]
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    z = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhs,bshd->bhd", p / z, v)
    return out, (np.log(z) + m)[..., 0]


def mask_empty_shards(lse: np.ndarray, local_seq_lens: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray:
    """float[T, H]: ``lse`` with the rows of requests this rank holds nothing of (local seq len 0)
    and the rows past the last request set to ``-inf``."""
    out = np.array(lse, dtype=np.float64, copy=True)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(local_seq_lens, dtype=np.int64)
    rows = np.arange(out.shape[0])
    if lens.size == 0:
        out[:] = -np.inf
        return out
    req = np.minimum(np.searchsorted(qsl[1:], rows, side="right"), lens.size - 1)
    empty = (rows >= qsl[-1]) | (lens[req] == 0)
    out[empty] = -np.inf
    return out


def _clean(lses: np.ndarray) -> np.ndarray:
    x = np.asarray(lses, dtype=np.float64)
    return np.where(np.isnan(x) | (x == np.inf), -np.inf, x)


def _total_lse(lses: np.ndarray) -> np.ndarray:  # [D, B, H] -> [B, H]
    x = _clean(lses)
    m = x.max(axis=0)
    m = np.where(m == -np.inf, 0.0, m)
    with np.errstate(divide="ignore"):
        return np.log(np.exp(x - m).sum(axis=0)) + m


def correct_rank_output(out: np.ndarray, lses: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(scaled out float64[B, H, Dv], total lse float64[B, H]): step 2 on one rank, from its own
    ``out`` and the all-gathered ``lses [D, B, H]``."""
    total = _total_lse(lses)
    diff = _clean(lses)[rank] - total
    diff = np.where(np.isnan(diff) | (diff == np.inf), -np.inf, diff)
    factor = np.exp(diff)[..., None]
    scaled = np.where(factor == 0.0, 0.0, np.asarray(out, dtype=np.float64) * factor)
    return scaled, total


def lse_combine(outs: np.ndarray, lses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out float64[B, H, Dv], lse float64[B, H]): the combined attention of ``D`` partial results
    ``outs [D, B, H, Dv]``, ``lses [D, B, H]``."""
    scaled = [correct_rank_output(outs[r], lses, r)[0] for r in range(len(outs))]
    return np.sum(scaled, axis=0), _total_lse(lses)


def ag_rs_combine(outs: np.ndarray, lses: np.ndarray) -> list[np.ndarray]:
    """Per DCP rank, float64[B, H/D, Dv]: what ``cp_lse_ag_out_rs`` leaves on each rank (its head
    slice of the combined output). ``H`` must be a multiple of ``D``."""
    d = len(outs)
    h = np.asarray(outs).shape[2]
    if h % d:
        raise ValueError(f"{h} heads cannot be reduce-scattered over {d} DCP ranks")
    total, _ = lse_combine(outs, lses)
    step = h // d
    return [total[:, r * step:(r + 1) * step] for r in range(d)]
