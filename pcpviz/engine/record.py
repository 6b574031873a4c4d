"""Assemble one step's trace views (names from ``pcpviz.trace.schema``).

The engine hands over the arrays it actually used — recording never recomputes
— so a fault shows up in the trace exactly as it happened. Copies are taken;
recording on or off runs the same arithmetic.

Values still on the device (sampled and draft tokens, the hidden states behind
``hidden_hash``) are held as ``Pending``: the recorder (``pcpviz.engine.recorder``)
copies them into pinned host memory without waiting and finishes them on its
writer thread, so recording adds no device sync to a step. Every method takes
keyword arguments only (``rec.verify(req_ids=..., num_draft=..., ...)``).
"""

from __future__ import annotations

import numpy as np
import torch

from pcpviz.trace.fingerprints import row_fingerprints
from pcpviz.trace.schema import segments_table

__all__ = ["StepRecord", "Pending", "row_hashes", "fingerprint"]


class Pending:
    """A view whose value is a device tensor: the recorder copies ``tensor`` to the host and
    stores ``finish(array)`` (``int64`` by default; ``row_hashes`` for hidden states)."""

    __slots__ = ("tensor", "finish")

    def __init__(self, tensor, finish=None) -> None:
        self.tensor = tensor.detach()
        self.finish = finish or _as_int64

    def resolve(self, host: np.ndarray):
        return self.finish(host)


def _as_int64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.int64).copy()


def _ints(x) -> np.ndarray | Pending:
    """An int64 copy of a host array; a device tensor stays ``Pending``."""
    return Pending(x) if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.int64).copy()


_ROW_HASH_WEIGHTS: dict[int, np.ndarray] = {}


def row_hashes(t) -> np.ndarray:
    """uint64[rows]: a per-row hash of a float tensor's (or float32 array's) bits
    (multiply-add, wrapping mod 2**64), so two runs can be compared row by row without
    storing hidden states."""
    a = np.ascontiguousarray(t.detach().float().cpu().numpy() if isinstance(t, torch.Tensor)
                             else np.asarray(t, dtype=np.float32))
    bits = a.view(np.uint32).reshape(a.shape[0], -1).astype(np.uint64)
    w = _ROW_HASH_WEIGHTS.get(bits.shape[1])
    if w is None:
        rng = np.random.default_rng(0x9C9F17)
        w = _ROW_HASH_WEIGHTS[bits.shape[1]] = rng.integers(1, 2**63, bits.shape[1], dtype=np.uint64) | 1
    with np.errstate(over="ignore"):
        return (bits * w).sum(axis=1, dtype=np.uint64)


def fingerprint(t: torch.Tensor) -> Pending:
    """``pcpviz.trace.fingerprints.row_fingerprints`` of ``t`` (rows of hidden states), left on
    the device for the recorder's thread (``Pending``): the step never waits for it."""
    return Pending(row_fingerprints(t))


class StepRecord:
    def __init__(self, step: int, rank: int, *, calls: list[str] | None = None) -> None:
        self.step = step
        self.rank = rank
        self.phases: dict[str, dict] = {}
        self.calls = calls  # the PCP group's ledger of this step's collectives (``dist.PCPGroup.start_step``)
        self._target_calls: int | None = None  # the ledger's length when the target phase ended (None: a replay)

    def target(self, *, batch, logits_indices, layout, local, local_positions, local_seq_lens, bt_local,
               table, slots_global, slots_gathered, sampled_rows, sampled_from, top1, hidden_global,
               t0, t1, hidden_local=None, eager=True, moe_gathers=False) -> None:
        """``hidden_global``: the restored hidden states [T, H] (a device tensor, hashed on the
        recorder's thread); ``top1``: the sampled token per sampled row (host or device);
        ``eager``: the forward ran without a CUDA-graph replay (its collectives were seen);
        ``moe_gathers``: the model's MoE layers gather every rank's rows (``moe_is_padding``)."""
        if self.calls is not None and eager:
            self._target_calls = len(self.calls)
        nr = local.num_reqs
        rows = table[batch.idx_mapping]
        used = np.flatnonzero(rows.any(axis=0)) if rows.size else np.zeros(0, np.int64)
        # Trim the tables to the columns any request of the step uses (the rest are 0).
        self.width = w = int(used[-1]) + 1 if used.size else 1
        self.phases["target"] = {
            # global batch
            "req_ids": np.array(batch.req_ids, dtype=str),
            "idx_mapping": batch.idx_mapping.copy(),
            "num_scheduled_tokens": batch.num_scheduled_tokens.copy(),
            "num_computed_tokens": batch.num_computed_tokens.copy(),
            "query_start_loc": batch.query_start_loc,
            "positions": batch.positions.copy(),
            "input_ids": batch.input_ids.copy(),
            "seq_lens": batch.seq_lens,
            "is_prefilling": batch.is_prefilling.copy(),
            "prefill_len": batch.prefill_len.copy(),
            "logits_indices": np.asarray(logits_indices, dtype=np.int64),
            # layout
            "segments": segments_table(layout.segments_by_rank),
            "per_rank_num_tokens": np.array(layout.per_rank_num_tokens, dtype=np.int64),
            "padded_gather_idx": layout.padded_gather_idx.copy(),
            "hidden_restore_idx": layout.hidden_restore_idx.copy(),
            "kv_write_mask": layout.kv_write_mask.copy(),
            # rank-local batch
            "local_req_ids": np.array(local.req_ids, dtype=str),
            "local_idx_mapping": local.idx_mapping.copy(),
            "local_input_ids": local.input_ids.astype(np.int64),
            "local_positions": np.asarray(local_positions, dtype=np.int64).copy(),
            "local_query_start_loc": local.query_start_loc[: nr + 1].astype(np.int64),
            "local_seq_lens": np.asarray(local_seq_lens[:nr], dtype=np.int64).copy(),
            "local_logits_indices": local.logits_indices[:nr].copy(),
            "local_is_padding": local.is_padding.copy(),
            **({"moe_is_padding": ~layout.is_real_row()} if moe_gathers else {}),  # rank-major [N*P]
            "local_is_prefilling": local.is_prefilling[:nr].copy(),
            "local_num_computed_tokens": local.num_computed_tokens.astype(np.int64),
            # block tables and slot mappings (one KV-cache group: G = 1)
            "block_table_global": rows[:, :w][None].astype(np.int32),
            "block_table_local": bt_local[:nr, :w][None].astype(np.int32),
            "slot_mapping_global": np.asarray(slots_global, dtype=np.int64).copy(),
            "slot_mapping_gathered": np.asarray(slots_gathered, dtype=np.int64).copy(),
            # sampling
            "sampled_logits_rows": np.asarray(sampled_rows, dtype=np.int64).copy(),
            "sampled_from": np.array(sampled_from),
            "top1_token": _ints(top1),
            "hidden_hash": Pending(hidden_global.float(), row_hashes)
            if isinstance(hidden_global, torch.Tensor) else row_hashes(hidden_global),
            "t_start_us": np.array(t0, dtype=np.int64),
            "t_end_us": np.array(t1, dtype=np.int64),
        }
        if isinstance(hidden_local, torch.Tensor):
            self.phases["target"]["hidden_local_fp"] = fingerprint(hidden_local)
            self.phases["target"]["hidden_fp"] = fingerprint(hidden_global)

    def fingerprints(self, phase: str, **tensors) -> None:
        """Per-row fingerprints of the hidden states a draft phase read and handed on
        (``hidden_in=``, ``hidden_out=``, ...: the views ``hidden_in_fp``, ``hidden_out_fp``)."""
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor):
                self.phases[phase][f"{name}_fp"] = fingerprint(t)

    def verify(self, *, req_ids, num_draft, v, k, t0, t1, num_computed_after=None) -> None:
        """The verify phase; ``num_computed_after`` ``int64[R]``: each request's GPU cursor once the
        verify rolled back its rejected drafts."""
        self.phases["verify"] = {
            "req_ids": np.array(req_ids, dtype=str),
            "num_draft_tokens": np.asarray(num_draft, dtype=np.int64).copy(),
            "sampled_token_ids": v.sampled_token_ids.copy(),
            "num_sampled": v.num_sampled.astype(np.int64),
            "num_rejected": v.num_rejected.astype(np.int64),
            "num_accepted": v.num_accepted.astype(np.int64),
            **({} if num_computed_after is None else
               {"num_computed_after": np.asarray(num_computed_after, dtype=np.int64).copy()}),
            "t_start_us": np.array(t0, dtype=np.int64),
            "t_end_us": np.array(t1, dtype=np.int64),
        }
        if self._target_calls is not None:
            self.collectives("target", self.calls[:self._target_calls])
            self.collectives("verify", self.calls[self._target_calls:])

    def draft_prefill(self, *, local_ids, local_positions, local_seq_lens, bt_local, slots_gathered,
                      last_idx, tokens, global_ids, t0, t1) -> None:
        nr = len(self.phases["target"]["local_req_ids"])
        self.phases["draft_0"] = {
            "view": np.array("rank_local"),
            "draft_input_ids": np.asarray(local_ids, dtype=np.int64).copy(),
            "draft_positions": np.asarray(local_positions, dtype=np.int64).copy(),
            "draft_seq_lens": np.asarray(local_seq_lens, dtype=np.int64)[:nr].copy(),
            "block_table_draft": bt_local[:nr, : self.width][None].astype(np.int32),
            "slot_mapping_draft": np.asarray(slots_gathered, dtype=np.int64).copy(),
            "draft_last_token_indices": np.asarray(last_idx, dtype=np.int64).copy(),
            "draft_tokens": _ints(tokens),
            "draft_global_input_ids": np.asarray(global_ids, dtype=np.int64).copy(),
            "t_start_us": np.array(t0, dtype=np.int64),
            "t_end_us": np.array(t1, dtype=np.int64),
        }

    def draft_decode(self, *, step, ids, positions, seq_lens, block_rows, slots, tokens, t0, t1) -> None:
        self.phases[f"draft_{step}"] = {
            "view": np.array("replicated"),
            "draft_input_ids": _ints(ids),
            "draft_positions": np.asarray(positions, dtype=np.int64).copy(),
            "draft_seq_lens": np.asarray(seq_lens, dtype=np.int64).copy(),
            "block_table_draft": np.asarray(block_rows, dtype=np.int32)[:, : self.width][None].copy(),
            "slot_mapping_draft": np.asarray(slots, dtype=np.int64)[None].copy(),
            "draft_tokens": _ints(tokens),
            "t_start_us": np.array(t0, dtype=np.int64),
            "t_end_us": np.array(t1, dtype=np.int64),
        }

    def collectives(self, phase: str, calls: list[str]) -> None:
        """The collectives the phase ran on this rank, in order (``trace.collectives.describe`` lines)."""
        if phase in self.phases:
            self.phases[phase]["collectives"] = np.array(calls, dtype=str)  # str[0] when none

    def dcp(self, phase: str, *, local_lens, ranks_combined: int, owner=None) -> None:
        """DCP > 1: this rank's local length of each row the phase attends (``dcp_local_seq_lens``:
        the target's and draft prefill's local rows; draft_k: the per-rank ``local_len`` of the
        draft decodes) and how many ranks' partial attention its combine summed."""
        self.phases[phase]["dcp_local_seq_lens"] = np.asarray(local_lens, dtype=np.int64).copy()
        self.phases[phase]["dcp_ranks_combined"] = np.array(int(ranks_combined), dtype=np.int64)
        if owner is not None:  # the target: the DCP rank each global token's KV was dealt to
            self.phases[phase]["dcp_owner"] = np.asarray(owner, dtype=np.int64).copy()


def kept_drafts(drafts: list, k: int) -> np.ndarray:
    """The view ``scheduled_draft_ids``: the drafts each request's state keeps for the step
    (``Worker._resolve_drafts`` stored them), ``int64[R, K]``, -1 past a request's own.

        >>> kept_drafts([np.array([5, 6]), np.array([], dtype=np.int64)], 2).tolist()
        [[5, 6], [-1, -1]]
    """
    out = np.full((len(drafts), k), -1, dtype=np.int64)
    for i, d in enumerate(drafts):
        d = np.asarray(d, dtype=np.int64)[:k]
        out[i, : d.shape[0]] = d
    return out
