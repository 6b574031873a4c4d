"""Decode context parallel (run.json ``dcp`` > 1): the KV cache sharded over the DCP ranks, from
first principles.

With ``D`` DCP ranks, interleave ``I`` and block size ``M``, the token at position ``p`` belongs
to DCP rank ``p % (M*D) // I % D`` and sits at its ``(p // (I*D)) * I + p % I``-th local slot
(``pcpviz.reference.dcp``, held against vLLM 0.33.0). So:

* a rank's slot mapping writes exactly the tokens it owns (PAD elsewhere), each to its own slot,
  and over the ranks every token is written once (``dcp_kv_sharding``);
* a rank's local length of a context of ``L`` tokens is how many of positions ``0..L-1`` it owns,
  and a draft decode this rank writes is read back at local index ``local_len - 1``
  (``dcp_local_lens``);
* the partial attention of every DCP rank is combined (``dcp_partial_combined``).

PCP=2, DCP=2, I=2, M=4, a request at positions 0..6 in block 5: rank 0 writes
``[20 21 -1 -1 22 23 -1]``, rank 1 ``[-1 -1 20 21 -1 -1 22]``, local lengths 4 and 3; a draft at
position 7 is rank 1's, at local index 3 = its new local_len 4 minus 1, slot 23.
"""

from __future__ import annotations

import numpy as np

from pcpviz.trace.shapes import slot_groups

from .columns import Block, bulk_skip
from .context import Ctx, Skip, check


_NOT_SHARDED = "dcp = 1: the KV cache is not sharded"


def _geometry(c: Ctx) -> tuple[int, int, int, int]:
    """(D, I, M, this rank's DCP rank); Skip without DCP."""
    if c.run_meta.dcp <= 1:
        raise Skip(_NOT_SHARDED)
    return c.run_meta.dcp, c.run_meta.dcp_interleave, c.block_sizes(1)[0], c.dcp_rank()


def _owner(pos: np.ndarray, d: int, il: int, m: int) -> np.ndarray:
    return pos.astype(np.int64) % (m * d) // il % d


def _owned_count(lens: np.ndarray, d: int, il: int, rank: int) -> np.ndarray:
    """How many of positions 0..L-1 rank ``rank`` owns, per L."""
    lens = lens.astype(np.int64)
    return lens // (il * d) * il + np.clip(lens % (il * d) - rank * il, 0, il)


def _writes(c: Ctx, phase: str, view: str, slots: np.ndarray, pos: np.ndarray, geo) -> None:
    d, il, m, me = geo
    owned = _owner(pos, d, il, m) == me
    c.expect(phase, view, want=owned, got=slots >= 0,
             what=f"DCP rank {me} must write exactly the tokens it owns (position % {m * d} // {il} % {d} == {me}), "
                  "PAD the others")
    written = slots[slots >= 0]
    uniq, first, counts = np.unique(written, return_index=True, return_counts=True)
    if (counts > 1).any():
        j = int(np.flatnonzero(slots >= 0)[first[np.argmax(counts > 1)]])
        c.fail(phase, view, f"slot {int(uniq[np.argmax(counts > 1)])} is written by {int(counts.max())} tokens "
               "on this rank", index=(0, j))


@check("dcp_kv_sharding",
       "DCP > 1: each rank's slot mappings (target slot_mapping_global, draft_k slot_mapping_draft) write "
       "exactly the tokens the interleave gives it (position % (block_size*D) // I % D), each to its own "
       "slot, and over the DCP ranks every token's KV is written exactly once")
def dcp_kv_sharding(c: Ctx) -> None:
    geo = _geometry(c)
    pos = c.t("positions").astype(np.int64)
    glob = slot_groups(c.t("slot_mapping_global"))[0][: pos.shape[0]]
    _writes(c, "target", "slot_mapping_global", glob, pos, geo)
    owner = c.get("target", "dcp_owner")
    if owner is not None:
        c.expect("target", "dcp_owner", want=_owner(pos, *geo[:3]), got=owner.astype(np.int64),
                 what="dcp_owner differs from the interleave rule")
    for _, phase in c.draft_phases(1):
        dp, sd = c.get(phase, "draft_positions"), c.get(phase, "slot_mapping_draft")
        if dp is not None and sd is not None:
            _writes(c, phase, "slot_mapping_draft", slot_groups(sd)[0], dp.astype(np.int64), geo)
    if c.run_meta.dcp_group == "pcp" and c.rank == 0 and len(c.sv.recs) >= geo[0]:
        writers = np.zeros(pos.shape[0], dtype=np.int64)
        for r in range(geo[0]):
            rec = c.sv.recs[r].get("target")
            views = getattr(rec, "views", rec) if rec is not None else {}
            other = views.get("slot_mapping_global")
            if other is not None:
                writers += slot_groups(np.asarray(other))[0][: pos.shape[0]] >= 0
        c.expect("target", "slot_mapping_global", want=np.ones_like(writers), got=writers,
                 what="DCP ranks writing this token's KV (exactly one)")


@check("dcp_local_lens",
       "DCP > 1: dcp_local_seq_lens counts the positions 0..L-1 this rank owns (target and draft_0: L = "
       "local_seq_lens; draft_k: L = draft_positions + 1, the draft decode's local_len), and a draft token "
       "this rank writes is where its attention reads local index local_len - 1")
def dcp_local_lens(c: Ctx) -> None:
    d, il, m, me = _geometry(c)
    seen = False
    for phase in ("target", "draft_0"):
        got = c.get(phase, "dcp_local_seq_lens")
        if got is None:
            continue
        seen = True
        lens = c.t("local_seq_lens").astype(np.int64)
        c.expect(phase, "dcp_local_seq_lens", want=_owned_count(lens, d, il, me), got=got.astype(np.int64),
                 what=f"local length on DCP rank {me} of local_seq_lens {lens.tolist()[:8]}")
    for _, phase in c.draft_phases(1):
        got, dp = c.get(phase, "dcp_local_seq_lens"), c.get(phase, "draft_positions")
        if got is None or dp is None:
            continue
        seen = True
        got, dp = got.astype(np.int64), dp.astype(np.int64)
        c.expect(phase, "dcp_local_seq_lens", want=_owned_count(dp + 1, d, il, me), got=got,
                 what=f"draft decode local_len on DCP rank {me} (positions {dp.tolist()[:8]} + 1)")
        sd, bt = c.get(phase, "slot_mapping_draft"), c.get(phase, "block_table_draft")
        if sd is None or bt is None:
            continue
        sd, bt = slot_groups(sd)[0], np.asarray(bt).reshape(-1, bt.shape[-2], bt.shape[-1])[0]
        mine = np.flatnonzero((sd >= 0) & (got > 0))
        last = got[mine] - 1
        ok = last // m < bt.shape[1]
        read = np.full(mine.shape[0], -2, dtype=np.int64)
        read[ok] = bt[mine[ok], last[ok] // m].astype(np.int64) * m + last[ok] % m
        if mine.size and (read != sd[mine]).any():
            i = int(np.argmax(read != sd[mine]))
            c.fail(phase, "dcp_local_seq_lens", f"request row {int(mine[i])}: the draft token is written to slot "
                   f"{int(sd[mine[i]])} but local_len {int(got[mine[i]])} reads local index {int(last[i])} at "
                   f"slot {int(read[i])}", index=(int(mine[i]),), expected=str(int(sd[mine[i]])),
                   actual=str(int(read[i])))
    if not seen:
        raise Skip("no dcp_local_seq_lens")


@check("dcp_partial_combined",
       "DCP > 1: every phase's attention combined the partial results of all D ranks "
       "(dcp_ranks_combined == dcp)")
def dcp_partial_combined(c: Ctx) -> None:
    d = _geometry(c)[0]
    phases = [("target", "target")] + [(p, p) for _, p in c.draft_phases(0)]
    seen = False
    for _, phase in phases:
        got = c.get(phase, "dcp_ranks_combined")
        if got is None:
            continue
        seen = True
        if int(got) != d:
            c.fail(phase, "dcp_ranks_combined", f"attention combined {int(got)} of {d} DCP ranks' partial results",
                   expected=str(d), actual=str(int(got)))
    if not seen:
        raise Skip("no dcp_ranks_combined")


def _dcp_off(b: Block, rank: int) -> list:
    """The DCP checks' first test (``_geometry``): without DCP every step skips."""
    return [_NOT_SHARDED if b.run_meta.dcp <= 1 else None] * len(b)


for _name in ("dcp_kv_sharding", "dcp_local_lens", "dcp_partial_combined"):
    bulk_skip(_name)(_dcp_off)
