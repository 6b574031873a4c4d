"""Plain-text drawings of a PCP layout (the ``pcpviz layout`` command).

Lanes draw one character per token: the request's letter (A = global row 0),
upper case for DualChunkSwap head chunks (chunk < N), lower case for tail
chunks, and ``.`` for padding rows.
"""

from __future__ import annotations

import string

import numpy as np

from pcpviz.reference.layout import PCPLayout

__all__ = ["render_layout"]

_LETTERS = string.ascii_uppercase


def _letter(req: int) -> str:
    return _LETTERS[req % 26]


def _lane_global(layout: PCPLayout) -> str:
    parts = []
    for req, q in enumerate(layout.num_scheduled_tokens.tolist()):
        if q:
            parts.append(_letter(req) * q)
    return " ".join(parts)


def _lane_rank(layout: PCPLayout, rank: int) -> str:
    n, p = layout.pcp_world_size, layout.padded_num_tokens
    chunk = layout.token_chunk()[rank * p : (rank + 1) * p]
    parts = []
    for seg in layout.segments_by_rank[rank]:
        c = int(chunk[seg.local_start])
        ch = _letter(seg.global_req_idx)
        parts.append((ch if c < n else ch.lower()) * seg.num_tokens)
    pad = p - layout.per_rank_num_tokens[rank]
    if pad:
        parts.append("." * pad)
    return " ".join(parts)


def _row_label(layout: PCPLayout, seg, req_names) -> str:
    name = req_names[seg.global_req_idx] if req_names else _letter(seg.global_req_idx)
    qs = int(layout.query_start_loc[seg.global_req_idx])
    lo, hi = seg.global_start - qs, seg.global_stop - qs
    if layout.replicated[seg.global_req_idx]:
        return f"{name}[{lo}:{hi}] decode"
    size = -(-int(layout.num_scheduled_tokens[seg.global_req_idx]) // (2 * layout.pcp_world_size))
    return f"{name}[{lo}:{hi}] chunk {lo // size}"


def _grid(label: str, values: np.ndarray, width: int, fmt=lambda v: str(v)) -> list[str]:
    cells = [fmt(v) for v in values.tolist()]
    w = max([len(c) for c in cells] + [1])
    lines = []
    for i in range(0, max(len(cells), 1), width):
        chunk = " ".join(c.rjust(w) for c in cells[i : i + width])
        lines.append(f"{label if i == 0 else '':<20}[{chunk}]")
    return lines


def render_layout(layout: PCPLayout, req_names: list[str] | None = None, width: int = 32, *,
                  row_specs: list[str] | None = None) -> str:
    """A multi-line text diagram: header, lanes, each rank's rows, and the
    gather / restore maps and the KV write mask per rank. ``row_specs`` (the batch rows as
    given, e.g. ``["p13", "d1", "d4"]``) adds a line naming each request: ``A = row 0 p13``."""
    n, p = layout.pcp_world_size, layout.padded_num_tokens
    mode = "sharded (one owner rank)" if layout.shard_decode_requests else "replicated (mask keeps rank 0's copy)"
    out = [
        f"PCP={n}  DCP={layout.dcp_world_size}  decodes: {mode}",
        f"T={layout.num_tokens} global tokens, P={p} rows per rank, "
        f"per-rank tokens {list(layout.per_rank_num_tokens)}",
    ]
    if row_specs is not None:
        names = req_names or [_letter(i) for i in range(len(row_specs))]
        out.append("requests: " + ", ".join(f"{name} = row {i} {spec}"
                                             for i, (name, spec) in enumerate(zip(names, row_specs))))
    out += [
        "",
        "lanes (letter = request; UPPER = head chunk, lower = tail chunk, . = padding)",
        f"  {'global':<8}{_lane_global(layout)}",
    ]
    for r in range(n):
        out.append(f"  {'rank ' + str(r):<8}{_lane_rank(layout, r)}")
    out.append("")
    for r in range(n):
        labels = []
        for seg in layout.segments_by_rank[r]:
            labels.append(_row_label(layout, seg, req_names))
        pad = p - layout.per_rank_num_tokens[r]
        tail = f"  + {pad} padding" if pad else ""
        out.append(f"rank {r} rows: " + (", ".join(labels) if labels else "(none)") + tail)
    out.append("")
    for r in range(n):
        rows = slice(r * p, (r + 1) * p)
        real = layout.is_real_row()[rows]
        gidx = np.where(real, layout.padded_gather_idx[rows], -1)
        out += _grid(f"gather_idx r{r}", gidx, width, lambda v: "." if v < 0 else str(v))
    for r in range(n):
        rows = slice(r * p, (r + 1) * p)
        mask = layout.kv_write_mask[rows]
        out += _grid(f"kv_write_mask r{r}", mask, width, lambda v: "W" if v else "-")
    out += _grid("hidden_restore_idx", layout.hidden_restore_idx, width)
    return "\n".join(out)
