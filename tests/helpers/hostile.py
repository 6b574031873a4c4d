"""Hostile copies of a trace with valid framing: every step re-written through ``TraceWriter``
after an edit of its views, so the damage is in what the producer "said", not in the bytes.

    rewrite(src, dst, lambda step, rank, phases: phases["target"].update(positions=...))

``EDITS`` is a table of attacks (sizes from input, shapes, strings) used by the fuzzer and the
CLI tests: each takes ``(rng, step, rank, phases)`` and edits ``phases`` in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

import pcpviz.trace as pt

__all__ = ["rewrite", "EDITS", "PAYLOADS", "inject_strings", "inject_meta"]

PAYLOADS = (
    '<img src="/api/contents/pcpviz-injected-1" onerror="window.__pcpviz_xss=1;alert(1)">',
    "<script>window.__pcpviz_xss=2;alert(2);fetch('/api/kernels?pcpviz-injected=2')</script>",
    '"><svg onload="window.__pcpviz_xss=3;alert(3)">',
    '</script><iframe src="/api/sessions?pcpviz-injected=4"></iframe>',
    "<b id=pcpviz-injected>5</b>{{7*7}}${alert(5)}",
    '<a href="javascript:alert(6)">javascript:alert(6)</a>',
)
"""Injection payloads: each would show a dialog, set ``window.__pcpviz_xss``, request a URL
with ``pcpviz-injected`` in it (the Jupyter API, with the user's session) or add an element
``#pcpviz-injected`` if a view ever rendered it as HTML."""


def rewrite(src: Path, dst: Path, edit: Callable[[int, int, dict], None], *,
            meta_edit: Callable[[dict], None] | None = None) -> Path:
    """Copy trace ``src`` to ``dst`` with ``edit(step, rank, phases)`` applied to every step."""
    t = pt.open(src)
    meta = {k: v for k, v in t.meta.items() if k != "pcpviz_trace_schema"}
    if meta_edit is not None:
        meta_edit(meta)
    dst.mkdir(parents=True, exist_ok=True)
    for rank in t.ranks:
        with pt.TraceWriter(dst, rank, meta=meta if rank == 0 else None) as w:
            for step in t.rank_steps(rank):
                phases = {ph: {k: np.array(v) for k, v in t.record(step, rank, ph).items()}
                          for ph in t.phases(step, rank)}
                edit(step, rank, phases)
                w.write_step(step, phases)
    return dst


def _set(phase: str, view: str, fn):
    def edit(rng, step, rank, phases):
        if phase in phases and view in phases[phase]:
            phases[phase][view] = fn(rng, np.asarray(phases[phase][view]))
    return edit


def _huge(rng, a):
    out = a.astype(np.int64).copy()
    if out.size:
        out.flat[rng.randrange(out.size)] = rng.choice((2**62, 2**40, -(2**62), 2**63 - 1))
    return out


def inject_strings(rng, step, rank, phases):
    """Every string view holds injection payloads (the same list for the same length, so the
    target's and the verify's request ids still agree)."""
    for views in phases.values():
        for name, v in list(views.items()):
            if v.dtype.kind == "U":
                views[name] = np.array([PAYLOADS[i % len(PAYLOADS)] + f"-{i}" for i in range(v.size)]
                                       ).reshape(v.shape) if v.size else v


EDITS = {
    "huge positions": _set("target", "positions", _huge),
    "huge seq_lens": _set("target", "seq_lens", _huge),
    "huge num_scheduled_tokens": _set("target", "num_scheduled_tokens", _huge),
    "huge query_start_loc": _set("target", "query_start_loc", _huge),
    "bogus query_start_loc": _set("target", "query_start_loc",
                                  lambda rng, a: a[::-1].copy() if a.size > 1 else a + 5),
    "huge slot_mapping": _set("target", "slot_mapping_global", _huge),
    "huge block_table": _set("target", "block_table_global", _huge),
    "huge num_sampled": _set("verify", "num_sampled", _huge),
    "huge num_draft_tokens": _set("verify", "num_draft_tokens", _huge),
    "huge segments": _set("target", "segments", lambda rng, a: _huge_struct(rng, a)),
    "huge per_rank_num_tokens": _set("target", "per_rank_num_tokens", _huge),
    "40-d view": _set("target", "positions", lambda rng, a: a.reshape((1,) * 39 + (-1,))),
    "3-d sampled": _set("verify", "sampled_token_ids", lambda rng, a: a[None]),
    "0-d positions": _set("target", "positions", lambda rng, a: np.array(7)),
    "long request id": _set("target", "req_ids", lambda rng, a: np.array(
        ["r" * 2_000_000] + a.tolist()[1:]) if a.size else a),
    "injected strings": inject_strings,
}


def _huge_struct(rng, a):
    out = a.copy()
    if out.size:
        name = rng.choice(out.dtype.names)
        out[name][rng.randrange(out.size)] = 2**62
    return out


def inject_meta(meta: dict) -> None:
    """Every string run.json key holds a payload (and a few more keys a header may show)."""
    for i, key in enumerate(("producer", "model", "device", "vllm_version", "speculative_method", "command")):
        meta[key] = PAYLOADS[i % len(PAYLOADS)]
    meta["inject"] = list(PAYLOADS[:2])
