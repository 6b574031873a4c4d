"""What one rank records for a synthetic step: the target phase (global batch, layout,
rank-local batch, block tables, slot mappings), ``draft_0`` (rank-local rows), ``draft_k``
(replicated) and ``verify``, with the fingerprints and, optionally, timestamps.

PCP=2, K=2: rank 1's ``draft_0`` holds its own rows of the draft-prefill ids
(``global_ids[padded_gather_idx]`` of its slice) and the gathered slot mapping; its ``draft_1``
has one row per request, equal on both ranks, with the unexpanded slot mapping.
"""

from __future__ import annotations

import numpy as np

from pcpviz import faults as F
from pcpviz.reference.blocks import draft_decode_slot_mapping, gather_block_table_rows
from pcpviz.reference.dcp import dcp_local_seq_lens, dcp_owner
from pcpviz.reference.layout import PCPLayout, partition_batch
from pcpviz.synthetic.settings import Settings
from pcpviz.synthetic.step import Drafts, Step, Verify
from pcpviz.trace import segments_table
from pcpviz.trace.fingerprints import synthetic_fingerprints

__all__ = ["rank_phases", "add_timestamps"]


def _positions_from_cpu_cursor(local, lqsl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """POSITIONS_FROM_CPU_CURSOR: local positions and seq_lens rebuilt from the CPU cursor."""
    lens = np.diff(lqsl)
    lpos = np.zeros_like(local.positions)
    lpos[:local.num_tokens] = (np.repeat(local.num_computed_tokens.astype(np.int64), lens)
                               + np.arange(local.num_tokens) - np.repeat(lqsl[:-1], lens))
    lsl = np.where(lens > 0, lpos[np.maximum(lqsl[1:] - 1, 0)] + 1, 0)
    return lpos, lsl


def rank_phases(rank: int, st: Step, layout: PCPLayout, *, full: np.ndarray, v: Verify, d: Drafts,
                 s: Settings, on: frozenset[str]) -> dict[str, dict[str, np.ndarray]]:
    """Every phase one rank records for the step: target, draft_0 (rank-local), draft_k (replicated), verify."""
    batch, qsl, k = st.batch, st.qsl, s.k
    idx_mapping = batch.idx_mapping
    slots_global, slots_gathered, bt_global = st.slot_mapping_global, st.slot_mapping_gathered, st.block_table_global
    local = partition_batch(batch, rank, s.pcp, layout=layout)
    r_loc = local.num_reqs
    bt_local = gather_block_table_rows(full, local.idx_mapping, local.num_reqs_padded)[None]
    lqsl = local.query_start_loc[:r_loc + 1].astype(np.int64)
    lpos, lsl = local.positions, local.seq_lens[:r_loc].astype(np.int64)
    if F.POSITIONS_FROM_CPU_CURSOR in on:
        lpos, lsl = _positions_from_cpu_cursor(local, lqsl)
    local_sampled = F.SAMPLE_LOCAL_LOGITS in on
    target = {
        "req_ids": np.array(batch.req_ids, dtype=str), "idx_mapping": idx_mapping,
        "num_scheduled_tokens": st.q, "num_computed_tokens": batch.num_computed_tokens.astype(np.int64),
        "query_start_loc": qsl, "positions": st.positions, "input_ids": st.input_ids, "seq_lens": st.seq_lens,
        "is_prefilling": st.prefilling, "prefill_len": batch.prefill_len.astype(np.int64),
        "logits_indices": st.logits_indices,
        "segments": segments_table(layout.segments_by_rank),
        "per_rank_num_tokens": np.array(layout.per_rank_num_tokens, dtype=np.int64),
        "padded_gather_idx": layout.padded_gather_idx, "hidden_restore_idx": layout.hidden_restore_idx,
        "kv_write_mask": layout.kv_write_mask,
        "local_req_ids": np.array(local.req_ids, dtype=str), "local_input_ids": local.input_ids.astype(np.int64),
        "local_positions": lpos, "local_query_start_loc": lqsl, "local_seq_lens": lsl,
        "local_logits_indices": local.logits_indices[:r_loc], "local_is_padding": local.is_padding,
        "local_is_prefilling": local.is_prefilling[:r_loc],
        "block_table_global": bt_global, "block_table_local": bt_local[:, :r_loc],
        "slot_mapping_global": slots_global, "slot_mapping_gathered": slots_gathered,
        "sampled_logits_rows": local.logits_indices[:r_loc] if local_sampled else st.logits_indices,
        "sampled_from": np.array("local" if local_sampled else "global"),
    }
    phases = {"target": target}
    if k > 0:
        phases["draft_0"] = {
            "view": np.array("rank_local"), "draft_input_ids": d.global_ids[local.gather_idx],
            "draft_positions": lpos, "draft_seq_lens": lsl, "block_table_draft": bt_local[:, :r_loc],
            "slot_mapping_draft": slots_gathered, "draft_last_token_indices": d.last_idx,
            "draft_tokens": d.tokens[:, 0], "draft_global_input_ids": d.global_ids,
        }
    for j in range(1, k):
        pj = d.positions[j - 1]
        slots = draft_decode_slot_mapping(full, s.block_size, idx_mapping, positions=pj, **s.dcp_kw)
        phases[f"draft_{j}"] = {
            "view": np.array("replicated"), "draft_input_ids": d.tokens[:, j - 1], "draft_positions": pj,
            "draft_seq_lens": pj + 1,
            "block_table_draft": np.zeros_like(bt_global) if F.SKIP_DRAFT_BLOCK_TABLE_GATHER in on else bt_global,
            "slot_mapping_draft": slots_gathered if F.EXPANDED_DRAFT_SLOT_MAPPING in on else slots,
            "draft_tokens": d.tokens[:, j],
        }
    if s.dcp > 1:
        _dcp_views(phases, s, lsl)
    synthetic_fingerprints(phases, rank, layout, positions=st.positions, input_ids=st.input_ids, n=s.pcp,
                           global_ids=d.global_ids, last_idx=d.last_idx)
    target["top1_token"] = np.asarray(v.top1, dtype=np.int64)
    phases["verify"] = {
        "req_ids": np.array(batch.req_ids, dtype=str), "num_draft_tokens": st.num_draft,
        "sampled_token_ids": v.sampled, "num_sampled": v.num_sampled, "num_rejected": v.num_rejected,
        "num_accepted": v.num_accepted,
        # the GPU cursor once the rejected drafts are rolled back (vLLM's post_update)
        "num_computed_after": np.array([r.computed for r in st.rows], dtype=np.int64) + st.q - v.num_rejected,
    }
    return phases


def add_timestamps(phases: dict[str, dict[str, np.ndarray]], t0: float, layout: PCPLayout, *, num_r: int) -> float:
    """``t_start_us`` / ``t_end_us`` (int64 µs, as declared) for each phase from ``t0`` on; the end."""
    tt = t0
    for phase, views in phases.items():
        dur = 20.0 + 0.05 * layout.padded_num_tokens if phase in ("target", "draft_0") else 5.0 + 0.1 * num_r
        views["t_start_us"] = np.array(round(tt), dtype=np.int64)
        views["t_end_us"] = np.array(round(tt + dur), dtype=np.int64)
        tt += dur + 1.0
    return tt


def _dcp_views(phases: dict, s: Settings, local_seq_lens: np.ndarray) -> None:
    """DCP > 1: ``dcp_owner`` and DCP rank 0's local lengths (the synthetic producer records DCP
    rank 0's share on every rank, run.json ``dcp_rank`` 0)."""
    kw = dict(dcp_size=s.dcp, interleave=s.dcp_interleave)
    target = phases["target"]
    target["dcp_owner"] = dcp_owner(target["positions"], block_size=s.block_size, **kw)
    target["dcp_local_seq_lens"] = dcp_local_seq_lens(local_seq_lens, **kw)[0].astype(np.int64)
    for name, views in phases.items():
        if name.startswith("draft_") and name != "draft_0":
            views["dcp_local_seq_lens"] = dcp_local_seq_lens(views["draft_positions"] + 1, **kw)[0].astype(np.int64)

