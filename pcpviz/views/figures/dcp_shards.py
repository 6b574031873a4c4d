"""The DCP shards view (run.json ``dcp`` > 1): which DCP rank holds each token's KV
(``dcp_owner``), this rank's share of the slot mapping (its slots, PAD where another rank holds
the token), its local length of each local row (``dcp_local_seq_lens`` against ``local_seq_lens``)
and, for a replicated draft step, the draft decodes' slots on this rank with their per-rank
``local_len``.

PCP=2, DCP=2, interleave 4 (``data/traces/cpu-pcp2-dcp2-mtp2``): the owner strip alternates
r0/r1 every 4 positions of each request; rank 0's slot strip shows slots in the r0 runs and PAD in
the r1 runs; a local row of seq_len 11 reads ``7/11`` on rank 0 and ``4/11`` on rank 1 (positions
0-3 and 8-10 against 4-7). Strips are drawn at a level of detail (``lod``): runs at 16k tokens,
tokens and their text when zoomed in.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from pcpviz.trace import Record
from pcpviz.trace.shapes import slot_groups
from pcpviz.views.figures.aggregate import run_edges
from pcpviz.views.figures.canvas import (L_NULL, L_PAD, L_REPLICA, L_WRITTEN, Canvas, range_text, req_levels,
                                         strip_heat, strip_labels)
from pcpviz.views.figures.lod import PLOT_PX, Lane, RunText, draw_strip
from pcpviz.views.figures.parts import SharedParts, add_part, drawn_part
from pcpviz.views.figures.slot_mappings import slot_strip
from pcpviz.views.figures.step_data import is_replicated, step_layout, view_array
from pcpviz.views.figures.violations import message_spec

__all__ = ["dcp_shards_spec", "rank_level"]


def rank_level(rank: int) -> float:
    """The colour level of a DCP rank: blue, orange, then the request palette."""
    return float((L_WRITTEN, L_REPLICA)[rank] if rank < 2 else 6 + rank)


def _owner_strip(owner: np.ndarray, req: np.ndarray) -> Lane:
    """Runs of equal (request, owner rank) over the global tokens: text r<k>."""
    e = run_edges(owner.shape[0], keys=[req, owner])
    a, b = e[:-1], e[1:]
    own = owner[a].tolist() if owner.size else []
    return Lane(e, np.array([rank_level(o) if o >= 0 else L_NULL for o in own], dtype=float),
                [(f"rank {o}", f"r{o}") if o >= 0 else "" for o in own],
                [f"global tokens {range_text(x, y - 1)}<br>KV on DCP rank {o}" for x, y, o in
                 zip(a.tolist(), b.tolist(), own)],
                RunText.per_run([f"r{o}" if o >= 0 else "" for o in own]))


def _lens_strip(local: np.ndarray, full: np.ndarray, req: np.ndarray, levels) -> Lane:
    """One cell per local row: ``local/L`` (this rank's share of the row's context)."""
    n = local.shape[0]
    e = np.arange(n + 1, dtype=np.int64)
    text = [f"{int(a)}/{int(b)}" for a, b in zip(local.tolist(), full.tolist())]
    return Lane(e, np.array([levels[q] if q >= 0 else L_NULL for q in req[:n].tolist()], dtype=float),
                text, [f"row {i}: {t} of the context's tokens on this rank" for i, t in enumerate(text)],
                RunText.per_run(text))


def _draft_strip(draft: Record, levels, num_reqs: int) -> Lane | None:
    sd, lens, pos = (view_array(draft, v) for v in ("slot_mapping_draft", "dcp_local_seq_lens", "draft_positions"))
    if sd is None or lens is None or pos is None:
        return None
    slots = slot_groups(sd)[0]
    r = min(slots.shape[0], lens.shape[0], pos.shape[0])
    text = [("PAD" if s < 0 else str(int(s)), f"len {int(n)}") for s, n in zip(slots[:r].tolist(), lens[:r].tolist())]
    hover = [f"request row {i}: draft at position {int(p)}<br>" + ("another rank writes it" if s < 0 else
             f"written to slot {int(s)}") + f"<br>local_len {int(n)}" for i, (s, n, p) in
             enumerate(zip(slots[:r].tolist(), lens[:r].tolist(), pos[:r].tolist()))]
    level = [L_PAD if s < 0 else levels[i] if i < num_reqs else L_NULL for i, s in enumerate(slots[:r].tolist())]
    return Lane(np.arange(r + 1, dtype=np.int64), np.asarray(level, dtype=float), [f"{a} · {b}" for a, b in text],
                hover, RunText.per_run([f"{a} · {b}" for a, b in text]))


def dcp_shards_spec(target: Record, draft: Record | None = None, *, rank: int | None = None,
                    draft_phase: str | None = None, highlight: str | None = None,
                    colors: Mapping[str, int] | None = None,
                    windows: Mapping[str, tuple[float, float]] | None = None, px: int = PLOT_PX,
                    parts: SharedParts | None = None) -> dict:
    """The DCP shards of one step on one rank (see the module docstring); a one-line note where
    the trace has no DCP views (``dcp`` = 1). ``parts``: strips drawn for other figures (the HTML
    report's pages), each drawn once per its lane's content (``drawn_part``)."""
    sl = step_layout(target)
    levels = req_levels(sl.req_ids, colors, highlight)
    t = sl.num_tokens
    owner = view_array(target, "dcp_owner")
    req = sl.token_req[:t]
    sg = slot_groups(view_array(target, "slot_mapping_global"))
    strips = []
    if owner is None:  # DCP = 1: no sharding; every rank's cache holds every token (its slots, all written)
        owner = np.zeros(t, dtype=np.int64)
        if sg is not None:
            strips.append((f"DCP = 1: rank {rank} stores every token's KV (slot_mapping_global [T={t}])",
                           slot_strip(sg[0][:t], req, None, levels, "global", "global token"), "global token"))
    else:
        owner = owner.astype(np.int64)[:t]
        strips.append((f"dcp_owner [T={t}]: the DCP rank holding each global token's KV", _owner_strip(owner, req),
                       "global token"))
    if sg is not None and strips and strips[0][0].startswith("dcp_owner"):
        mine = int(np.sum(sg[0][:t] >= 0))
        strips.append((f"rank {rank}'s slot_mapping_global: its share ({mine} of {t} tokens; PAD = another rank's)",
                       slot_strip(sg[0][:t], req, None, levels, "global", "global token"), "global token"))
    local, full = view_array(target, "dcp_local_seq_lens"), view_array(target, "local_seq_lens")
    if local is not None and full is not None:
        n = min(local.shape[0], full.shape[0])
        lreq = _local_row_req(target, n)
        strips.append((f"dcp_local_seq_lens [r={n}]: this rank's local length / local_seq_lens",
                       _lens_strip(local[:n], full[:n], lreq, levels), "local row"))
    if draft is not None and is_replicated(draft, target):
        lane = _draft_strip(draft, levels, sl.num_reqs)
        if lane is not None:
            strips.append((f"{draft_phase} on rank {rank}: slot written (PAD: another rank's) · local_len",
                           lane, "request row (global order)"))
    if not strips:
        return message_spec(f"DCP shards: step without slot_mapping_global on rank {rank}")
    fig = Canvas([[1]] * len(strips), vertical_spacing=0.5 / len(strips), subplot_titles=[s[0] for s in strips])
    windows = windows or {}
    for k, (_, lane, xtitle) in enumerate(strips):
        xr, yr = fig.ref(k + 1, 1)
        window = windows.get("xaxis" + xr[1:])

        def draw(lane=lane, window=window, xr=xr, yr=yr) -> tuple:
            d = draw_strip([lane], window=window, px=px, font_size=9)
            return d, strip_heat(d, [""], font_size=9, ygap=0), strip_labels(xr, yr, d, font_size=9)

        d = add_part(fig, drawn_part(parts, ("dcp_shards", lane, window, px, xr, yr), draw), (k + 1, 1), parts=parts)
        fig.axis("y", k + 1, 1, showticklabels=False)
        fig.axis("x", k + 1, 1, title=dict(text=xtitle, standoff=0, font=dict(size=10)), range=list(d.window))
    counts = np.bincount(owner[owner >= 0], minlength=int(owner.max(initial=0)) + 1).tolist()
    return fig.spec(height=130 + 105 * len(strips), margin=dict(l=30, r=20, t=70, b=40),
                    title=dict(text=f"DCP shards (rank {rank}; tokens per DCP rank {counts}; T = {t})"))


def _local_row_req(target: Record, n: int) -> np.ndarray:
    """int64[n]: the global request row of each local row (-1 where unknown)."""
    lid, rid = view_array(target, "local_req_ids"), view_array(target, "req_ids")
    out = np.full(n, -1, dtype=np.int64)
    if lid is None or rid is None:
        return out
    index = {str(x): i for i, x in enumerate(np.asarray(rid).tolist())}
    for i, x in enumerate(np.asarray(lid).tolist()[:n]):
        out[i] = index.get(str(x), -1)
    return out
