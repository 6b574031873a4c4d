"""The engine's own decode context parallel (DCP) attention: the KV cache sharded over the PCP
ranks, partial attention on each shard, partial results combined by their log-sum-exp.

**Not a vLLM 0.33.0 configuration.** vLLM 0.33.0 allows PCP + DCP for sparse-MLA models only
(``pcp_manager.py`` 195-200); the shipped model is dense MLA. The arithmetic is vLLM's: the KV is
written by the rule of ``pcpviz.reference.dcp`` (each token on one rank, at its local offset;
``dcp_group`` 'pcp': DCP = PCP at TP=1, DCP rank = PCP rank), a rank attends over its local tokens
``0..local_len-1``, and the results are combined as ``pcpviz.reference.dcp_combine`` does
(``cp_lse_ag_out_rs``). Where it departs from vLLM, on purpose:

* **target and draft prefill rows differ per rank** under PCP, so the engine all-gathers the
  queries (``[P] -> [N*P]`` rows), every rank attends all ``N*P`` rows over its shard, and the
  combine sums the LSE-corrected outputs of all ranks (an all-gather; gloo has no
  reduce-scatter). vLLM's sparse-MLA prefill gathers the KV instead.
* **draft decodes 1..K-1** run the same rows on every rank: partial attention, all-gather of the
  LSEs, correction, sum over ranks (vLLM: reduce-scatter over heads then an all-gather of the
  head slices, ``finalize_mla_pcp_decode``; the same numbers at TP=1).

PCP=2, DCP=2, interleave 1: a decode at position 4 of a request sees keys 0..4; rank 0 holds
positions 0, 2, 4 (local_len 3), rank 1 positions 1, 3 (local_len 2). Each attends its shard, and
``out = sum_r exp(lse_r - lse) * out_r``: attention over all five keys.

The torch path runs on CPU and CUDA alike (the Triton kernels of ``pcpviz_kernels`` have no
LSE output and are not used under DCP).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pcpviz.engine.kv_cache import context_slots
from pcpviz.reference.blocks import gather_block_table_rows
from pcpviz.reference.layout import partition_batch
from pcpviz.reference.dcp import dcp_local_seq_lens, draft_local_lens

__all__ = ["DCPRows", "dcp_rows_host", "dcp_rows_of", "dcp_step_inputs", "dcp_partial_mla", "dcp_combine"]


@dataclass(frozen=True)
class DCPRows:
    """The rows a rank's DCP attention attends, with this rank's local lengths.

    ``gather_queries``: the phase's rows differ per rank (target, draft prefill): the queries are
    all-gathered, rows of rank j are ``[j*P, (j+1)*P)``; else (draft decodes) every rank has the
    same rows."""

    block_rows: torch.Tensor  # int32[B', W]
    query_start_loc: torch.Tensor  # int64[B'+1]
    local_q_lens: torch.Tensor  # int64[Q']: keys a query sees on this rank, local_len(position + 1)
    local_seq_lens: torch.Tensor  # int64[B']: this rank's local length of each row's context
    gather_queries: bool


def dcp_rows_host(locals_by_rank, block_rows_by_rank, *, dcp_rank: int, dcp_size: int, interleave: int,
                  ) -> dict[str, np.ndarray]:
    """Host arrays of the target's ``DCPRows`` over every rank's local batch (``LocalBatch`` per
    rank j, its gathered block-table rows): ``dcp_block_rows`` int32[B', W], ``dcp_qsl``
    int64[B'+1] (rank j's rows offset by ``j*P``), ``dcp_qlens`` int64[N*P], ``dcp_seqlens``
    int64[B'] (``B'`` = the ranks' real rows, in rank order)."""
    p = {int(lb.num_tokens_padded) for lb in locals_by_rank}
    if len(p) != 1:
        raise ValueError(f"ranks' padded local rows differ ({sorted(p)}): the query all-gather needs one P")
    pad = p.pop()
    rows, qsl, qlens, seqlens = [], [0], np.zeros(pad * len(locals_by_rank), dtype=np.int64), []
    for j, (lb, bt) in enumerate(zip(locals_by_rank, block_rows_by_rank)):
        nr = int(lb.num_reqs)
        q = np.asarray(lb.query_start_loc[: nr + 1], dtype=np.int64)
        rows.append(np.asarray(bt)[:nr])
        qsl.extend((q[1:] + j * pad).tolist())
        real = int(q[-1]) if nr else 0
        qlens[j * pad: j * pad + real] = draft_local_lens(np.asarray(lb.positions[:real]), dcp_size=dcp_size,
                                                          interleave=interleave)[dcp_rank]
        seqlens.append(dcp_local_seq_lens(np.asarray(lb.seq_lens[:nr]), dcp_size=dcp_size,
                                          interleave=interleave)[dcp_rank].astype(np.int64))
    width = max((r.shape[1] for r in rows), default=1)
    return {"dcp_block_rows": np.concatenate([r[:, :width] for r in rows]).astype(np.int32)
            if rows else np.zeros((0, width), np.int32),
            "dcp_qsl": np.asarray(qsl, dtype=np.int64), "dcp_qlens": qlens,
            "dcp_seqlens": np.concatenate(seqlens) if seqlens else np.zeros(0, np.int64)}


def dcp_step_inputs(batch, layout, local, *, rank: int, world: int, table: np.ndarray, bt_local: np.ndarray,
                    dcp: int, interleave: int) -> dict:
    """The worker's DCP step inputs: ``dcp_rows`` (``dcp_rows_host`` over every rank's local batch,
    ``partition_batch`` of the others recomputed on this rank) and ``dcp_local_seq_lens`` (int64[r]:
    this rank's share of its own local rows' seq_lens)."""
    locs = [local if j == rank else partition_batch(batch, j, world, layout=layout) for j in range(world)]
    bts = [bt_local if j == rank else gather_block_table_rows(table, lb.idx_mapping, lb.num_reqs_padded)
           for j, lb in enumerate(locs)]
    rows = dcp_rows_host(locs, bts, dcp_rank=rank, dcp_size=dcp, interleave=interleave)
    mine = dcp_local_seq_lens(np.asarray(local.seq_lens[: local.num_reqs]), dcp_size=dcp, interleave=interleave)
    return {"dcp_rows": rows, "dcp_local_seq_lens": mine[rank].astype(np.int64)}


def dcp_partial_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, *, rows: DCPRows,
                    w_uk: torch.Tensor, block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent context float32[Q, H, R], lse float32[Q, H]): absorbed MLA of every query over this
    rank's shard only (local tokens ``0..local_q_lens[q]-1``); no keys: context 0, lse -inf."""
    r = w_uk.shape[-1]
    ctx = torch.zeros(q_nope.shape[0], q_nope.shape[1], r, dtype=torch.float32, device=q_nope.device)
    lse = torch.full(q_nope.shape[:2], float("-inf"), dtype=torch.float32, device=q_nope.device)
    qsl = rows.query_start_loc.tolist()
    lens = rows.local_seq_lens.tolist()
    for b, n in enumerate(lens):
        lo, hi = qsl[b], qsl[b + 1]
        if hi <= lo or n <= 0:
            continue
        lat = cache[context_slots(rows.block_rows[b], int(n), block_size)].float()  # [n, R + Dr]
        kv_c, k_pe = lat[:, :r], lat[:, r:]
        q_lat = torch.einsum("qhd,hdr->qhr", q_nope[lo:hi].float(), w_uk.float())
        s = (torch.einsum("qhr,kr->qhk", q_lat, kv_c) + torch.einsum("qhd,kd->qhk", q_pe[lo:hi].float(), k_pe)) * scale
        hidden = torch.arange(int(n), device=s.device)[None, :] >= rows.local_q_lens[lo:hi, None]
        s = s.masked_fill(hidden[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [q, H]; -inf where the query sees no local key
        probs = torch.where(torch.isinf(row_lse)[..., None], torch.zeros_like(s), torch.exp(s - row_lse[..., None]))
        ctx[lo:hi] = torch.einsum("qhk,kr->qhr", probs, kv_c)
        lse[lo:hi] = row_lse
    return ctx, lse


def dcp_combine(ctx: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """(combined float32[Q, H, R], ranks combined): all-gather the LSEs, scale this rank's
    context by ``exp(lse_r - lse)``, sum the scaled contexts of every rank (an all-gather and a
    sum: the reduce of vLLM's reduce-scatter plus its head all-gather)."""
    n = group.world_size
    lses = group.all_gather(lse.contiguous()).reshape(n, *lse.shape)  # [N, Q, H]
    m = lses.max(dim=0).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    total = torch.log(torch.exp(lses - m).sum(dim=0)) + m
    factor = torch.exp(lse - total)
    factor = torch.where(torch.isnan(factor), torch.zeros_like(factor), factor)
    scaled = torch.where(factor[..., None] == 0, torch.zeros_like(ctx), ctx * factor[..., None])
    summed = group.all_gather(scaled.contiguous()).reshape(n, *ctx.shape).sum(dim=0)
    return summed, n


def dcp_rows_of(d: dict) -> DCPRows | None:
    """The target's (and the draft prefill's) ``DCPRows`` from its device inputs (``dcp_*``, built
    from ``dcp_rows_host``), None without DCP."""
    if "dcp_qsl" not in d:
        return None
    return DCPRows(block_rows=d["dcp_block_rows"], query_start_loc=d["dcp_qsl"], local_q_lens=d["dcp_qlens"],
                   local_seq_lens=d["dcp_seqlens"], gather_queries=True)

